"""The one place that patches vLLM's server side (vLLM 0.32) — every patch listed, reversible.

Installed by our ``vllm.general_plugins`` entry point (:func:`install` in ``vllm_plugin.register``)
in every vLLM process; :func:`uninstall` puts every original object back (reference-counted;
an inherited attribute is inherited again; tested in ``tests/e2e/test_server_routes.py``).
Worker-side hooks that act on a running model (route and support capture) live in
``vllm_ext.py`` / ``capture.py`` and are installed per engine on request; this module holds the patches of
vLLM's own classes and module globals.

``vllm.entrypoints.serve.middleware.authenticate.GUARDED_PREFIX``
    vLLM's ``--api-key`` middleware checks only paths under ``/v1``, ``/v2``, ``/inference`` and
    ``/cohere``: with ``VLLM_SERVER_DEV_MODE=1`` anyone who reaches the port can call
    ``/init_weight_transfer_engine``, ``/update_weights``, ``/collective_rpc``, ``/pause``, ...
    and replace or break the served model (seen here: an unauthenticated ``/start_weight_update``
    of the nccl backend left the weights on the meta device). While installed, every control
    route (:data:`CONTROL_ROUTES`) needs the key too; ``/health``, ``/ping``, ``/version``,
    ``/metrics`` and ``/load`` stay open for probes. Without ``--api-key`` nothing is checked,
    as before (``skyrl-numerics serve`` refuses a non-loopback address without one).
``vllm.v1.engine.async_llm.AsyncLLM.finish_weight_update``
    vLLM does not reset the prefix cache after a weight update, so a later request sharing a
    prefix would attend to KV computed with the old weights. The wrapper runs the original and
    then ``reset_prefix_cache()``; when requests are still running (``/pause?mode=keep``) it
    resets with ``reset_running_requests=True``: those requests are recomputed from their tokens
    on the new weights, so no token sampled after an update attends to old-weight KV.
``vllm.config.vllm.VllmConfig._verify_aux_output_compatibility``
    vLLM fills ``routed_experts`` (``--enable-return-routed-experts``) only in Model Runner V2,
    which needs Triton on GPU, and refuses the flag otherwise ("AuxOutput Connector requires
    Model Runner V2"). On the CPU platform, when the flag is set and V2 is not in use, the
    wrapper runs vLLM's check as if V2 were selected: every other requirement (a generate
    runner, an MoE model, prefix caching, no PP / context parallelism / PD connectors) is still
    enforced. Elsewhere, and without the flag, vLLM's check runs unchanged.
``vllm.config.vllm.VllmConfig._verify_sampling_replay_config``
    The same for ``--return-sampling-mask`` ("sampling distribution replay requires Model
    Runner V2"); vLLM's other checks (``processed_logprobs``, no custom logits processors, no
    adaptive speculative verification) still run, and the request-level ones (``temperature
    > 0``, ``top_k > 0``) are vLLM's own, unchanged.
``vllm.v1.worker.cpu_model_runner.CPUModelRunner.execute_model`` and ``.sample_tokens``
    (CPU platform only; set on the subclass, the inherited V1 methods are untouched.) When
    either output above is on, the wrappers do on the V1 runner what the V2 runner does:
    ``execute_model`` hands the step's ``scheduler_output`` (its
    ``aux_output_connector_metadata``: emit starts, finished requests, generation) to the
    runner's :class:`~skyrl_numerics.trainer.engine.capture.AuxOutputs` before the forward;
    the ``ModelRunnerOutput`` of the step then gets ``aux_output_connector_output =
    {req_id: AuxRequestOutput(emit_start, rows)}`` for every request that sampled a token and
    ``sampling_masks`` (CSR supports), from the route capture on vLLM's router hook and the
    support capture on its sampler (``capture.py`` documents how rows are computed). vLLM's
    scheduler, output processor and API serialization (``routed_experts`` base64 ``.npy`` in
    ``/v1/completions``, ``/v1/chat/completions``, ``/inference/v1/generate``; ``sampling_mask``
    in ``/inference/v1/generate``) do the rest, unchanged. With neither output on, the wrappers
    only call the originals. (vLLM CPU turns async scheduling off; an ``AsyncModelRunnerOutput``
    would be passed through without the outputs.)
"""
from __future__ import annotations

import contextlib
import functools
import threading

__all__ = ["install", "uninstall", "installed", "patched", "CONTROL_ROUTES", "OPEN_ROUTES"]

OPEN_ROUTES = ("/health", "/ping", "/version", "/metrics", "/load")
CONTROL_ROUTES = (
    "/abort_requests", "/collective_rpc", "/fault_tolerance", "/finish_weight_update",
    "/get_world_size", "/init_weight_transfer_engine", "/is_paused", "/is_scaling_elastic_ep",
    "/is_sleeping", "/kv_event_sources", "/pause", "/release_kv_cache_memory", "/reset_",
    "/resume", "/scale_elastic_ep", "/server_info", "/shutdown_weight_transfer_engine", "/sleep",
    "/start_", "/stop_profile", "/tokenize", "/detokenize", "/tokenizer_info", "/update_",
    "/wake_up", "/weight_", "/classify", "/score", "/rerank", "/pooling", "/invocations",
    "/generative_scoring", "/openapi.json", "/docs", "/redoc",
)

_lock = threading.RLock()
_depth = 0
# (owner, attribute, original, whether the owner held it itself rather than inheriting it)
_saved: list[tuple[object, str, object, bool]] = []


def _set(owner, name: str, value) -> None:
    own = not isinstance(owner, type) or name in vars(owner)
    _saved.append((owner, name, getattr(owner, name), own))
    setattr(owner, name, value)


def _guard_control_routes() -> None:
    from vllm.entrypoints.serve.middleware import authenticate

    _set(authenticate, "GUARDED_PREFIX", tuple(authenticate.GUARDED_PREFIX) + CONTROL_ROUTES)


def _reset_prefix_cache_after_update() -> None:
    from vllm.v1.engine.async_llm import AsyncLLM

    original = AsyncLLM.finish_weight_update

    @functools.wraps(original)
    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await original(self, weight_version)
        if not await self.reset_prefix_cache():
            await self.reset_prefix_cache(reset_running_requests=True)

    finish_weight_update.skyrl_original = original
    _set(AsyncLLM, "finish_weight_update", finish_weight_update)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class _AsIfV2:
    """A view of a ``VllmConfig`` that reports Model Runner V2 as selected (every other
    attribute, read or written, is the config's own)."""

    use_v2_model_runner = True

    def __init__(self, config):
        object.__setattr__(self, "_config", config)

    def __getattr__(self, name):
        return getattr(self._config, name)

    def __setattr__(self, name, value):
        setattr(self._config, name, value)


def _relax_v2_checks_on_cpu() -> None:
    from vllm.config.vllm import VllmConfig

    def relax(name: str, wanted) -> None:
        original = getattr(VllmConfig, name)

        @functools.wraps(original)
        def check(self) -> None:
            if wanted(self) and not self.use_v2_model_runner and _on_cpu():
                return original(_AsIfV2(self))   # our CPU runner patches provide the outputs
            return original(self)

        check.skyrl_original = original
        _set(VllmConfig, name, check)

    relax("_verify_aux_output_compatibility", lambda c: c.aux_output_config.enabled)
    relax("_verify_sampling_replay_config",
          lambda c: c.model_config is not None and c.model_config.return_sampling_mask)


def _aux_outputs_wanted(runner) -> bool:
    vc = runner.vllm_config
    return bool(vc.aux_output_config.enable_return_routed_experts
                or getattr(vc.model_config, "return_sampling_mask", False))


def _cpu_runner_aux_outputs() -> None:
    if not _on_cpu():
        return
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    original_execute = CPUModelRunner.execute_model
    original_sample = CPUModelRunner.sample_tokens

    def aux_of(runner):
        if not _aux_outputs_wanted(runner):
            return None
        from .capture import AuxOutputs

        return AuxOutputs.of(runner)

    @functools.wraps(original_execute)
    def execute_model(self, scheduler_output, intermediate_tensors=None):
        aux = aux_of(self)
        if aux is None:
            return original_execute(self, scheduler_output, intermediate_tensors)
        aux.begin_step(scheduler_output)
        out = original_execute(self, scheduler_output, intermediate_tensors)
        if isinstance(out, ModelRunnerOutput):   # a step that returns without sampling
            aux.fill(out)
        return out

    @functools.wraps(original_sample)
    def sample_tokens(self, grammar_output):
        out = original_sample(self, grammar_output)
        aux = aux_of(self)
        if aux is not None and isinstance(out, ModelRunnerOutput):
            aux.fill(out)
        return out

    execute_model.skyrl_original = original_execute
    sample_tokens.skyrl_original = original_sample
    _set(CPUModelRunner, "execute_model", execute_model)
    _set(CPUModelRunner, "sample_tokens", sample_tokens)


_PATCHES = (_guard_control_routes, _reset_prefix_cache_after_update, _relax_v2_checks_on_cpu,
            _cpu_runner_aux_outputs)


def install() -> None:
    """Apply every patch (reference-counted: nested installs need as many uninstalls)."""
    global _depth
    with _lock:
        if _depth == 0:
            try:
                for patch in _PATCHES:
                    patch()
            except BaseException:
                _restore()
                raise
        _depth += 1


def _restore() -> None:
    while _saved:
        owner, name, original, own = _saved.pop()
        if own:
            setattr(owner, name, original)
        else:   # it was inherited: drop the override, the base class's attribute shows again
            delattr(owner, name)


def uninstall() -> None:
    """Undo one :func:`install`; the last one puts every original object back."""
    global _depth
    with _lock:
        if _depth == 0:
            return
        _depth -= 1
        if _depth == 0:
            _restore()


def installed() -> bool:
    return _depth > 0


@contextlib.contextmanager
def patched():
    """``with patched(): ...`` — the patches for the duration of the block."""
    install()
    try:
        yield
    finally:
        uninstall()
