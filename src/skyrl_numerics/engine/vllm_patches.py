"""The one place that patches vLLM (0.30 - 0.32) — every patch listed, reversible, tested.

Two kinds. **Class and module patches** (the first list below) are installed by our
``vllm.general_plugins`` entry point (:func:`install` in ``vllm_plugin.register``) in every vLLM
process; :func:`uninstall` puts every original object back (reference-counted; an inherited
attribute is inherited again; :func:`patches` lists them; tested in
``tests/e2e/test_server_routes.py``). **Instance patches** (:data:`INSTANCE_PATCHES`, the second
list) replace an attribute of *one* object of a running engine (its sampler, its MLA layers, its
model) on request; each goes through :func:`patch_instance`, which refuses an unlisted one and
returns the function that puts the original back (tested in
``tests/engine/test_vllm_instance_patches.py``, on real vLLM classes). Both kinds are recorded,
applied and undone by the project's patch registry (``skyrl_numerics.patching``), which also
refuses a patch of an attribute that is not there, and an undo out of order or of a value
replaced behind its back. Nothing else in the project assigns to an attribute of a vLLM object.

Not patches (public hooks, nothing of vLLM's is replaced; listed so nobody looks for them here):
the route capture's ``BaseRouter.set_capture_fn`` (vLLM's own capture hook, ``route_store.py``), the
``route_hook`` attribute of our own batch-invariant model (``invariant/base.py``), and the MLA
schedule recorder's ``register_forward_pre_hook`` on the engine's token embedding
(``mla_worker.py``).

Class and module patches (:func:`install`)
------------------------------------------

Each applies from a vLLM release on (:data:`SINCE`; ``make compat`` runs them on every tested
release, engine/vllm_versions.py): on an older release it is left out, and what it provides is
refused by name where it is asked for (``serve_command``: ``--sampling-mask``).

``vllm.entrypoints.serve.middleware.authenticate.GUARDED_PREFIX``
    vLLM's ``--api-key`` middleware checks only paths under ``/v1``, ``/v2``, ``/inference`` and
    ``/cohere``: with ``VLLM_SERVER_DEV_MODE=1`` anyone who reaches the port can call
    ``/init_weight_transfer_engine``, ``/update_weights``, ``/collective_rpc``, ``/pause``, ...
    and replace or break the served model (seen here: an unauthenticated ``/start_weight_update``
    of the nccl backend left the weights on the meta device). While installed, every control
    route (:data:`CONTROL_ROUTES`) needs the key too; ``/health``, ``/ping``, ``/version``,
    ``/metrics`` and ``/load`` stay open for probes. Without ``--api-key`` nothing is checked,
    as before (``skyrl-numerics serve`` refuses a non-loopback address without one). Our own
    data-plane routes outside vLLM's prefixes (:data:`DATA_ROUTES`: SkyRL's ``/skyrl/v1/generate``)
    need it as well.
``vllm.plugins.load_endpoint_plugins``
    vLLM's endpoint plugins (``vllm.endpoint_plugins`` entry points, allowlisted by
    ``VLLM_PLUGINS``) are its interface for adding HTTP routes. The wrapper returns vLLM's own list
    plus :class:`~skyrl_numerics.engine.skyrl_route.SkyrlEndpoints` (for servers that support the
    ``generate`` task), which attaches SkyRL 0.4's ``POST /skyrl/v1/generate`` and ``POST
    /fetch_weights`` (its delta fetch step, a control route behind ``--api-key``;
    ``skyrl_fetch.py``) to servers started with our worker extension only (SkyRL's own servers add
    their own routes);
    ``attach_endpoint_plugins`` / ``init_endpoint_plugins_state`` then wire it as any plugin.
    Setting ``VLLM_PLUGINS`` is not needed (it would also filter the general plugins).
``vllm.v1.engine.async_llm.AsyncLLM.finish_weight_update``
    vLLM does not reset the prefix cache after a weight update, so a later request sharing a
    prefix would attend to KV computed with the old weights. The wrapper runs the original and
    then ``reset_prefix_cache()``; when requests are still running (``/pause?mode=keep``) it
    resets with ``reset_running_requests=True``: those requests are recomputed from their tokens
    on the new weights, so no token sampled after an update attends to old-weight KV.
    A client that finishes without naming a ``weight_version`` (SkyRL's control-plane client never
    names one) gets the version the ``skyrl_delta`` backend loaded recorded instead (the workers'
    ``skyrl_applied_version``, when they agree), so ``/weight_info`` says what is served.
``vllm.config.vllm.VllmConfig._verify_aux_output_compatibility`` (vLLM >= 0.31)
    vLLM fills ``routed_experts`` (``--enable-return-routed-experts``) only in Model Runner V2,
    which needs Triton on GPU, and refuses the flag otherwise ("AuxOutput Connector requires
    Model Runner V2"). On the CPU platform, when the flag is set and V2 is not in use, the
    wrapper runs vLLM's check as if V2 were selected: every other requirement (a generate
    runner, an MoE model, prefix caching, no PP / context parallelism / PD connectors) is still
    enforced. Elsewhere, and without the flag, vLLM's check runs unchanged.
``vllm.config.vllm.VllmConfig._verify_sampling_replay_config`` (vLLM >= 0.31)
    The same for ``--return-sampling-mask`` ("sampling distribution replay requires Model
    Runner V2"); vLLM's other checks (``processed_logprobs``, no custom logits processors, no
    adaptive speculative verification) still run, and the request-level ones (``temperature
    > 0``, ``top_k > 0``) are vLLM's own, unchanged.
``vllm.v1.worker.cpu_model_runner.CPUModelRunner.execute_model`` and ``.sample_tokens`` (vLLM >= 0.31)
    (CPU platform only; set on the subclass, the inherited V1 methods are untouched.) When
    either output above is on, the wrappers do on the V1 runner what the V2 runner does:
    ``execute_model`` hands the step's ``scheduler_output`` (its
    ``aux_output_connector_metadata``: emit starts, finished requests, generation) to the
    runner's :class:`~skyrl_numerics.engine.aux_outputs.AuxOutputs` before the forward;
    the ``ModelRunnerOutput`` of the step then gets ``aux_output_connector_output =
    {req_id: AuxRequestOutput(emit_start, rows)}`` for every request that sampled a token and
    ``sampling_masks`` (CSR supports), from the route capture on vLLM's router hook and the
    support capture on its sampler (``route_store.py`` / ``support_store.py`` document how rows are computed). vLLM's
    scheduler, output processor and API serialization (``routed_experts`` base64 ``.npy`` in
    ``/v1/completions``, ``/v1/chat/completions``, ``/inference/v1/generate``; ``sampling_mask``
    in ``/inference/v1/generate``) do the rest, unchanged. With neither output on, the wrappers
    only call the originals. (vLLM CPU turns async scheduling off; an ``AsyncModelRunnerOutput``
    would be passed through without the outputs.)

``vllm.v1.worker.gpu_input_batch.InputBatch.add_request`` and ``vllm.v1.sample.sampler.Sampler.forward``
    (CPU platform only.) A seeded request (``SamplingParams.seed``: our ``generate(seed=...)``
    seeds every request by default) owns a ``torch.Generator``; a step that prefills only part
    of its prompt (chunked prefill: any batch over ``max_num_batched_tokens``, 4096 by default
    on CPU) still samples for it and then discards the token, and the runner undoes the draw
    with ``gen.set_offset(gen.get_offset() - 4)`` — a CUDA (Philox) notion: a CPU generator
    raises "CPU Generator does not use offset" and the engine dies (``EngineDeadError``; seen
    here with 24 prompts x 400 tokens at the defaults). The ``add_request`` wrapper gives each
    seeded request a :class:`RewindableGenerator` (a ``torch.Generator`` subclass, the same
    state; set on the request's ``generator`` too, so it survives a preemption) and the
    ``Sampler.forward`` wrapper marks each one's state before the step samples; the runner's
    rewind then restores that state. A seeded request draws the same numbers however its prompt
    is chunked (tested: bitwise the tokens of an engine that does not chunk).
``vllm.entrypoints.serve.register_vllm_dev_api_routers``
    vLLM attaches its development routes (``VLLM_SERVER_DEV_MODE=1``: ``/collective_rpc``,
    ``/server_info``, ...) with this function, looked up by name when the app is built. The
    wrapper runs it and then attaches one route of ours, ``GET /skyrl_contract``: the execution
    contract the engine's worker computes (``collective_rpc("skyrl_contract")``, vllm_ext.py;
    ``invariant/contract.py``), read by ``RemoteGenerator.contract()``. It is a control route
    (``/skyrl_`` in :data:`CONTROL_ROUTES`): behind ``--api-key`` like the others.

Instance patches (:func:`patch_instance`, keys of :data:`INSTANCE_PATCHES`)
---------------------------------------------------------------------------

``"sampler.forward"``: ``TopKTopPSampler.forward`` of one runner's sampler (:func:`wrap_sampler`)
    vLLM picks the sampling function per platform and stores it as an *instance* attribute
    (``self.forward = self.forward_cpu``); the support capture (``skyrl_support_capture_start``,
    and ``AuxOutputs`` for ``--return-sampling-mask``) wraps it so every sampled row's support
    (the ids with a finite processed logit) is recorded. The wrapper calls the original and
    returns its result unchanged. Undone by ``skyrl_support_capture_stop`` / ``AuxOutputs.close``.
``"sampler.digest.forward"``: ``Sampler.forward`` of one runner's sampler (:func:`wrap_sampler_logits`)
    The logits digest (``skyrl_logits_digest_start``, ``digest_store.DigestStore``) must see the rows
    ``model.compute_logits`` produced, as the sampler receives them, before it converts and
    processes them (with float32 logits its processors may work in place). vLLM's runner calls
    ``self.sampler(logits=..., sampling_metadata=...)``, i.e. the instance's ``forward``: the
    wrapper hashes each row and calls the original with the same arguments, returning its result
    unchanged. Undone by ``skyrl_logits_digest_stop``.
``"mla.rotary_emb"``: ``MultiHeadLatentAttentionWrapper.rotary_emb`` of every MLA layer of one
model (:func:`rowwise_mla_rope`)
    vLLM 0.32 CPU's rotary kernel, called on MLA's 3-D q/k *views*, rotates query head ``r %
    heads`` of token ``r // heads`` by the position of token ``r`` (docs/mla.md); the
    replacement (:class:`_RowwiseRope`) calls vLLM's own rotary layer on 2-D contiguous copies,
    so every head and key is rotated by its own position. Installed by ``MLARopeFixExtension``
    when route capture starts (a diagnostic engine of the doctor; kept for the engine's life).
``"model.forward"``: ``forward`` of the runner's model (``benchmarks/bench_vllm_invariant.py``)
    the benchmark's per-forward timer (``--forward-times``): the wrapper calls the original
    forward and records its start, duration and token count. Kept for the engine's life.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from fastapi import Request
from fastapi.responses import JSONResponse

from ..patching import PatchSet, live, patch, restore
from .vllm_versions import release_of, returns_routed_experts

__all__ = ["install", "uninstall", "installed", "patched", "patches", "applies",
           "aux_outputs_patched", "SINCE", "CONTROL_ROUTES", "CONTRACT_ROUTE", "DATA_ROUTES",
           "OPEN_ROUTES", "INSTANCE_PATCHES", "patch_instance", "instance_patches", "wrap_sampler",
           "wrap_sampler_logits", "rowwise_mla_rope"]

OPEN_ROUTES = ("/health", "/ping", "/version", "/metrics", "/load")
CONTROL_ROUTES = (
    "/abort_requests", "/collective_rpc", "/fault_tolerance", "/finish_weight_update",
    "/get_world_size", "/init_weight_transfer_engine", "/is_paused", "/is_scaling_elastic_ep",
    "/is_sleeping", "/kv_event_sources", "/pause", "/release_kv_cache_memory", "/reset_",
    "/resume", "/scale_elastic_ep", "/server_info", "/shutdown_weight_transfer_engine", "/sleep",
    "/start_", "/stop_profile", "/tokenize", "/detokenize", "/tokenizer_info", "/update_",
    "/fetch_weights",
    "/wake_up", "/weight_", "/classify", "/score", "/rerank", "/pooling", "/invocations",
    "/generative_scoring", "/openapi.json", "/docs", "/redoc", "/skyrl_",
)
# data-plane routes of ours outside vLLM's guarded prefixes (SkyRL's generate: skyrl_route.py)
DATA_ROUTES = ("/skyrl",)
CONTRACT_ROUTE = "/skyrl_contract"

def _guard_control_routes() -> None:
    from vllm.entrypoints.serve.middleware import authenticate

    _SET.set(authenticate, "GUARDED_PREFIX",
             tuple(authenticate.GUARDED_PREFIX) + CONTROL_ROUTES + DATA_ROUTES)


def _skyrl_endpoints() -> None:
    import vllm.plugins as plugins

    original = plugins.load_endpoint_plugins

    @functools.wraps(original)
    def load_endpoint_plugins(supported_tasks=None):
        from .skyrl_route import SkyrlEndpoints

        found = list(original(supported_tasks))
        ours = SkyrlEndpoints()
        if supported_tasks is not None and set(ours.required_tasks) & set(supported_tasks):
            found.append(ours)
        return found

    load_endpoint_plugins.skyrl_original = original
    _SET.set(plugins, "load_endpoint_plugins", load_endpoint_plugins)


def _reset_prefix_cache_after_update() -> None:
    from vllm.v1.engine.async_llm import AsyncLLM

    original = AsyncLLM.finish_weight_update

    @functools.wraps(original)
    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await original(self, weight_version)
        if weight_version is None:
            await _record_applied_version(self)
        if not await self.reset_prefix_cache():
            await self.reset_prefix_cache(reset_running_requests=True)

    finish_weight_update.skyrl_original = original
    _SET.set(AsyncLLM, "finish_weight_update", finish_weight_update)


def _contract_route() -> None:
    import vllm.entrypoints.serve as serve

    original = serve.register_vllm_dev_api_routers

    @functools.wraps(original)
    def register_vllm_dev_api_routers(app) -> None:
        original(app)
        app.add_api_route(CONTRACT_ROUTE, _contract_endpoint, methods=["GET"])

    register_vllm_dev_api_routers.skyrl_original = original
    _SET.set(serve, "register_vllm_dev_api_routers", register_vllm_dev_api_routers)


async def _contract_endpoint(request: Request):
    """``GET /skyrl_contract``: ``{"contract": worker 0's, "workers": every worker's}``."""
    results = await request.app.state.engine_client.collective_rpc("skyrl_contract")
    return JSONResponse({"contract": results[0], "workers": list(results)})


async def _record_applied_version(llm) -> None:
    """A client that finishes an update without naming its version (SkyRL's): record the version
    the ``skyrl_delta`` backend loaded, when every worker loaded the same one."""
    cfg = llm.vllm_config.weight_transfer_config
    if cfg is None or getattr(cfg, "backend", None) != "skyrl_delta":
        return
    versions = set(await llm.collective_rpc("skyrl_applied_version"))
    if len(versions) == 1 and None not in versions:
        await llm.update_weight_version(str(versions.pop()))


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
        _SET.set(VllmConfig, name, check)

    relax("_verify_aux_output_compatibility", lambda c: c.aux_output_config.enabled)
    relax("_verify_sampling_replay_config",
          lambda c: c.model_config is not None and c.model_config.return_sampling_mask)


def _aux_outputs_wanted(runner) -> bool:
    vc = runner.vllm_config
    return bool(returns_routed_experts(vc)
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
        from .aux_outputs import AuxOutputs

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
    _SET.set(CPUModelRunner, "execute_model", execute_model)
    _SET.set(CPUModelRunner, "sample_tokens", sample_tokens)


class RewindableGenerator(torch.Generator):
    """A CPU generator whose last sampling step can be undone: :meth:`mark` keeps its state
    (the sampler calls it before each step), and the runner's discard rewind
    ``set_offset(get_offset() - 4)`` puts that state back (any offset argument: on CPU one step
    is one mark)."""

    def mark(self) -> None:
        self.before = self.get_state()

    def get_offset(self) -> int:
        return 0

    def set_offset(self, offset: int) -> "RewindableGenerator":
        before = getattr(self, "before", None)
        if before is not None:
            self.set_state(before)
        return self

    @classmethod
    def like(cls, gen: torch.Generator) -> "RewindableGenerator":
        out = cls(device="cpu")
        out.set_state(gen.get_state())
        return out


def _rewindable_cpu_seeds() -> None:
    if not _on_cpu():
        return
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker.gpu_input_batch import InputBatch

    original_add, original_forward = InputBatch.add_request, Sampler.forward

    @functools.wraps(original_add)
    def add_request(self, request):
        index = original_add(self, request)
        gen = getattr(request, "generator", None)
        if gen is not None and gen.device.type == "cpu" and not isinstance(gen, RewindableGenerator):
            request.generator = self.generators[index] = RewindableGenerator.like(gen)
        return index

    @functools.wraps(original_forward)
    def forward(self, logits, sampling_metadata, *args, **kwargs):
        for gen in (getattr(sampling_metadata, "generators", None) or {}).values():
            if isinstance(gen, RewindableGenerator):
                gen.mark()
        return original_forward(self, logits, sampling_metadata, *args, **kwargs)

    add_request.skyrl_original, forward.skyrl_original = original_add, original_forward
    _SET.set(InputBatch, "add_request", add_request)
    _SET.set(Sampler, "forward", forward)


_PATCHES = (_guard_control_routes, _skyrl_endpoints, _reset_prefix_cache_after_update,
            _relax_v2_checks_on_cpu, _cpu_runner_aux_outputs, _contract_route, _rewindable_cpu_seeds)

# The first vLLM release (major, minor) each patch applies to. vLLM 0.30 has no AuxOutput
# connector (``aux_output_config``, ``ModelRunnerOutput.aux_output_connector_output``): its V1
# runner returns ``routed_experts`` through a capturer of its own, so the two patches that put
# the V2 outputs on the CPU runner have nothing to wrap there.
SINCE = {_relax_v2_checks_on_cpu: (0, 31), _cpu_runner_aux_outputs: (0, 31)}


def applies(p, version: str) -> bool:
    """Whether patch function ``p`` applies to vLLM ``version`` (:data:`SINCE`)."""
    rel = release_of(version)
    return rel is None or rel[:2] >= SINCE.get(p, (0, 0))


def aux_outputs_patched(version: str) -> bool:
    """Whether this release gets the CPU runner's ``routed_experts`` / ``sampling_mask`` patches."""
    return applies(_cpu_runner_aux_outputs, version)


def _apply() -> None:
    import vllm

    for p in _PATCHES:
        if applies(p, vllm.__version__):
            p()


# the class and module patches, installed together (patching.PatchSet: reference-counted; an
# attribute the owner held is set back, an inherited one is deleted so it is inherited again)
_SET = PatchSet("vllm_patches", _apply)


def install() -> None:
    """Apply every patch (reference-counted: nested installs need as many uninstalls)."""
    _SET.install()


def uninstall() -> None:
    """Undo one :func:`install`; the last one puts every original object back."""
    _SET.uninstall()


def installed() -> bool:
    return _SET.installed()


def patches() -> list[str]:
    """``owner.attribute`` of every class and module patch in place, in the order applied."""
    return [p.where for p in _SET.patches()]


@contextlib.contextmanager
def patched():
    """``with patched(): ...`` — the patches for the duration of the block."""
    install()
    try:
        yield
    finally:
        uninstall()


# ---- instance patches ---------------------------------------------------------------------------

# key -> (the vLLM class whose instances it applies to, by name, the attribute); reasons above
INSTANCE_PATCHES = {
    "sampler.forward": ("TopKTopPSampler", "forward"),
    "sampler.digest.forward": ("Sampler", "forward"),
    "mla.rotary_emb": ("MultiHeadLatentAttentionWrapper", "rotary_emb"),
    "model.forward": (None, "forward"),    # any model class the runner holds
}

_INSTANCE_BY = "vllm_patches.patch_instance"


def patch_instance(obj, name: str, value, *, what: str):
    """Set ``obj.<name> = value`` for the listed instance patch ``what`` (a key of
    :data:`INSTANCE_PATCHES`, whose class and attribute must match) and return ``undo()``, which
    puts the original back: the object's own attribute (its ``__dict__``, or an ``nn.Module``'s
    submodule / parameter / buffer) is set again, one it got from its class is removed so the
    class's shows again (``patching.restore``). ``undo`` is idempotent; the registry holds ``obj``
    weakly, so a patch kept for an engine's life does not keep its model alive."""
    if what not in INSTANCE_PATCHES:
        raise KeyError(f"{what!r} is not a listed vLLM instance patch ({sorted(INSTANCE_PATCHES)});"
                       " list it (with its reason) in vllm_patches.py first")
    cls_name, attr = INSTANCE_PATCHES[what]
    if name != attr or (cls_name is not None
                        and cls_name not in (c.__name__ for c in type(obj).__mro__)):
        raise TypeError(f"instance patch {what!r} applies to {cls_name or 'any'}.{attr}, "
                        f"not {type(obj).__name__}.{name}")
    p = patch(obj, name, value, by=_INSTANCE_BY, what=what)

    def undo() -> None:
        restore(p)
    return undo


def instance_patches() -> list[tuple[str, str]]:
    """The instance patches in place in this process: ``(key, type name of the object)``."""
    return [(p.what, type(o).__name__) for p in live(_INSTANCE_BY) if (o := p.owner) is not None]


def wrap_sampler(runner, store):
    """Wrap the runner's top-k/top-p sampler so every sampled row's support reaches ``store``;
    returns the function that puts the original back."""
    tts = runner.sampler.topk_topp_sampler
    orig = tts.forward

    def forward(logits, generators, k, p):
        # processed_logprobs / processed_logits return the truncated distribution itself;
        # otherwise keep a copy of the logits (the sampler may mask them in place)
        keep = None if tts.logprobs_mode.startswith("processed") else logits.clone()
        sampled, processed = orig(logits, generators, k, p)
        store.capture(keep, k, p, processed)
        return sampled, processed

    return patch_instance(tts, "forward", forward, what="sampler.forward")


def wrap_sampler_logits(runner, store):
    """Wrap the runner's sampler so every logits row it receives reaches ``store.capture`` first
    (before the sampler touches it); returns the function that puts the original back."""
    sampler = runner.sampler
    orig = sampler.forward

    def forward(*args, **kwargs):
        store.capture(kwargs["logits"] if "logits" in kwargs else args[0])
        return orig(*args, **kwargs)

    return patch_instance(sampler, "forward", forward, what="sampler.digest.forward")


class _RowwiseRope(torch.nn.Module):
    """Calls vLLM's rotary op on 2-D ``[tokens, heads * rope]`` copies of MLA's 3-D q/k views,
    the layout its CPU kernel handles, and returns them in the views' shapes."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, positions, query, key=None):
        T = positions.numel()
        q2 = query.reshape(T, -1).contiguous()
        k2 = None if key is None else key.reshape(T, -1).contiguous()
        q2, k2 = self.inner(positions, q2, k2)
        return q2.view(query.shape), (None if key is None else k2.view(key.shape))


def rowwise_mla_rope(model):
    """Route every MLA layer's rotary call of ``model`` through 2-D contiguous copies
    (:class:`_RowwiseRope`), so vLLM CPU rotates every query head and key by its own position.
    Returns ``(layers patched, undo)``; layers already patched are left alone."""
    undos = []
    for m in model.modules():
        rot = getattr(m, "rotary_emb", None)
        if type(m).__name__ == "MultiHeadLatentAttentionWrapper" and rot is not None \
                and not isinstance(rot, _RowwiseRope):
            undos.append(patch_instance(m, "rotary_emb", _RowwiseRope(rot), what="mla.rotary_emb"))

    def undo() -> None:
        for u in reversed(undos):
            u()
    return len(undos), undo
