"""Load new weights into a RUNNING ``vllm.LLM`` in place (no restart): ``update_vllm_weights``.

Mechanism (vLLM 0.32, CPU and GPU)
----------------------------------
1. The caller's tensors (checkpoint / HF names, any dtype) are written to one safetensors file in a
   fresh staging directory (``/dev/shm`` when writable, so it stays in RAM).
2. ``llm.collective_rpc("skyrl_load_weights", args=(path,))`` runs
   ``SkyrlWorkerExtension.skyrl_load_weights`` (``engine/vllm_ext.py``) in every worker. It streams the file into
   ``model_runner.reload_weights(weights_iterator=..., is_checkpoint_format=True)``: vLLM's own
   ``model.load_weights`` maps the HF names onto its fused parameters (``qkv_proj``,
   ``gate_up_proj``, experts ``w13``/``w2``), re-runs ``process_weights_after_loading`` per layer
   and copies the result into the *existing* parameter storage, so kernels (and CUDA graphs) keep
   their pointers.
3. The prefix cache is reset: KV blocks computed with the old weights must not be reused.

Only the method *name* and a path cross the RPC, so the engine needs no
``VLLM_ALLOW_INSECURE_SERIALIZATION``; it does need the extension, which vLLM mixes into its
worker class when the engine is started with ``worker_extension_cls=WORKER_EXTENSION``
(see :func:`engine_kwargs`).

Why an extension rather than the stock ``collective_rpc("reload_weights", ...)``
--------------------------------------------------------------------------------
On CPU, vLLM 0.32 prepacks unquantized MoE expert weights into its grouped-GEMM layout
(``CPUUnquantizedExperts.process_weights_after_loading``) only on the *first* load: a reload takes
the ``is_weight_update`` branch of ``UnquantizedFusedMoEMethod._setup_kernel``, skips the prepack,
and copies the unpacked weights into the packed storage, so the experts compute garbage (measured
here: NaN logprobs after a one-expert update, a restored checkpoint not reproducing its rollouts).
The extension clears ``quant_method.moe_kernel`` on CPU before the reload, so every reloaded MoE
layer takes the first-load path (pad + prepack) and the packed result is copied into place; layers
the update does not touch get their old kernel back.

Partial updates
---------------
vLLM processes a layer when *all* of its weights have arrived; a layer that gets only part of its
fused parameter (say ``q_proj`` without ``k_proj``/``v_proj``) is finalized with uninitialized
memory for the rest. :func:`update_vllm_weights` therefore checks, against the checkpoint's tensor
names, that a partial update holds whole blocks: every tensor under ``model.layers.<i>.<block>``
(``self_attn``, ``mlp``, a norm, ...) or under a top-level module (``lm_head``, ...). This is a
superset of every fusion vLLM does inside a block.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from skyrl_numerics.atomic import atomic_file
from skyrl_numerics.errors import InputError
from skyrl_numerics.sync.load_blocks import check_complete_blocks, checkpoint_names, expand_to_blocks

WORKER_EXTENSION = "skyrl_numerics.engine.vllm_ext.SkyrlWorkerExtension"
_STAGING_FILE = "model.safetensors"

#: stock vLLM CPU 0.32 models that do not take new weights in place, with what goes wrong
#: (measured: perturb the HF weights group by group, sync, compare the engine's logprobs with HF's)
STOCK_RELOAD_BROKEN_CPU = {
    "GptOssForCausalLM": "new expert weights and biases do not reach its experts (engine vs "
                         "trainer mean |Δ| 2.2e-3 -> 7.7e-2 after one sync of perturbed experts; "
                         "attention, sinks and router follow); its load_weights copies them with "
                         "param.copy_, not through the weight loaders vLLM's layerwise reload tracks",
    "NemotronHForCausalLM": "new Mamba-2 conv1d weights do not reach its mixers (engine vs trainer "
                            "mean |Δ| 3.6e-3 -> 6.9e-2 after one sync of a perturbed conv1d; A_log, "
                            "dt_bias and D follow)",
}


def stock_reload_problem(architecture: str | None) -> str | None:
    """Why a stock (not batch-invariant) vLLM engine of ``architecture`` cannot follow the trainer
    through in-place weight updates on this platform, or None. CPU only: measured there (GPU: not
    measured)."""
    import torch

    if torch.cuda.is_available():
        return None
    return STOCK_RELOAD_BROKEN_CPU.get(architecture or "")


def engine_kwargs() -> dict[str, Any]:
    """Extra ``vllm.LLM`` / ``get_generator`` arguments an engine needs for in-place updates."""
    return {"worker_extension_cls": WORKER_EXTENSION}


# ---- worker side: the methods (skyrl_load_weights, ...) are in the one worker extension,
# ``engine/vllm_ext.py::SkyrlWorkerExtension``; this module's part of it is the load path --------
def load_into_model(vllm_config, model, weights: Iterable[tuple[str, Any]], *, reload=None) -> int:
    """Load ``(checkpoint name, tensor)`` pairs into a live vLLM ``model`` in place; returns how
    many were loaded. The one load path of every in-place update (this module's worker extension
    and the ``skyrl_delta`` weight-transfer backend, ``sync/vllm_backend.py``).

    vLLM's layerwise reload (``model_loader.reload``) maps the names onto fused parameters and
    re-runs ``process_weights_after_loading``; on CPU the unquantized MoE kernels are parked
    first (module docstring). The batch-invariant model holds its weights under checkpoint names
    and copies them in place itself. ``reload``: the worker's own ``reload_weights`` when called
    from one. The default, under this config, is the checkpoint-format reload made of the
    package's public functions — ``initialize_layerwise_reload(model)``,
    ``model.load_weights(...)``, ``finalize_layerwise_reload(model, model_config)`` — the same in
    vLLM 0.30 - 0.32 (0.32 wraps them in ``reload.inplace.reload_weights``, a module 0.30 and
    0.31 do not have; their runners run the three calls inline)."""
    problem = None if getattr(model, "skyrl_invariant", False) else stock_reload_problem(type(model).__name__)
    if problem:     # the one load path: no caller gets a silently stale engine
        raise InputError(f"{type(model).__name__}: in-place weight update refused: {problem}",
                         field="architectures")
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                         initialize_layerwise_reload)

    def default_reload(weights_iterator, is_checkpoint_format):
        if not is_checkpoint_format:
            raise ValueError("load_into_model loads checkpoint-format weights only")
        with set_current_vllm_config(vllm_config):
            initialize_layerwise_reload(model)
            model.load_weights(weights_iterator)
            finalize_layerwise_reload(model, vllm_config.model_config)

    reload = reload or default_reload
    names: list[str] = []

    def counted():
        for name, t in weights:
            names.append(name)
            yield name, t

    if getattr(model, "skyrl_invariant", False):
        model.load_weights(counted())
        return len(names)
    parked = _park_cpu_moe_kernels(model)
    try:
        reload(weights_iterator=counted(), is_checkpoint_format=True)
    finally:
        for qm, kernel in parked:
            if qm.moe_kernel is None:  # layer was not reloaded: keep its old kernel
                qm.moe_kernel = kernel
    return len(names)


def _park_cpu_moe_kernels(model) -> list[tuple[Any, Any]]:
    """On CPU, detach each unquantized MoE method's kernel so a reload re-runs the prepack."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return []
    try:
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
            UnquantizedFusedMoEMethod,
        )
    except ImportError:  # pragma: no cover - other vLLM layouts
        return []
    parked = []
    for module in model.modules():
        qm = getattr(module, "quant_method", None)
        if isinstance(qm, UnquantizedFusedMoEMethod) and qm.moe_kernel is not None:
            parked.append((qm, qm.moe_kernel))
            qm.moe_kernel = None
    return parked


# ---- caller side ----------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineUpdate:
    """What one in-place update did."""

    tensors: int
    bytes: int
    stage_s: float   # writing the staging file
    load_s: float    # the RPC: reading + vLLM's load + re-processing, all workers
    total_s: float


def engine_of(llm):
    """Accept a ``vllm.LLM`` or anything holding one as ``.llm`` (e.g. ``VLLMGenerator``)."""
    inner = getattr(llm, "llm", None)
    return inner if inner is not None and hasattr(inner, "collective_rpc") else llm


def _require_extension(engine) -> None:
    """The engine's worker class must carry ``skyrl_load_weights`` (this module's mixin)."""
    qualname = getattr(engine.llm_engine.vllm_config.parallel_config, "worker_extension_cls", "")
    ok = False
    if qualname:
        import importlib

        mod, _, cls = qualname.rpartition(".")
        try:
            ok = callable(getattr(getattr(importlib.import_module(mod), cls), "skyrl_load_weights",
                                  None))
        except (ImportError, AttributeError):
            ok = False
    if not ok:
        raise InputError(f"the engine's worker_extension_cls ({qualname!r}) has no "
                         "skyrl_load_weights; start it with worker_extension_cls="
                         f"{WORKER_EXTENSION!r} or a class that inherits it", field="llm")


def _default_staging() -> str | None:
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


def update_vllm_weights(llm, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], *,
                        staging_dir: str | os.PathLike | None = None,
                        reset_prefix_cache: bool = True,
                        all_names: Iterable[str] | None = None,
                        changed: Iterable[str] | None = None) -> EngineUpdate:
    """Load ``named_tensors`` (checkpoint names -> CPU tensors) into the running engine in place.

    ``llm``: a ``vllm.LLM`` started with :func:`engine_kwargs`, or a ``VLLMGenerator``.
    ``all_names``: the full set of checkpoint tensor names, for the whole-block check; default:
    read from the engine's model directory. ``changed``: names that changed (e.g. the
    ``Manifest.changed`` of the versions just applied); with it, ``named_tensors`` is a full state
    and only the blocks holding a changed tensor are sent. Returns an :class:`EngineUpdate`. Raises
    ``InputError`` for names the checkpoint lacks, partial blocks, or an engine without the
    extension; the engine is untouched in those cases.
    """
    import torch
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    engine = engine_of(llm)
    if not hasattr(engine, "collective_rpc") or not hasattr(engine, "llm_engine"):
        raise InputError(f"expected a running vllm.LLM or a VLLMGenerator, got "
                         f"{type(llm).__name__} (closed?)", field="llm")
    _require_extension(engine)
    arch = (getattr(engine.llm_engine.model_config.hf_config, "architectures", None) or [None])[0]
    problem = stock_reload_problem(arch)
    if problem:
        raise InputError(f"{arch}: in-place weight update refused: {problem}; the batch-invariant "
                         "engine takes them (batch_invariant=True)", field="architectures")
    items = dict(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    if not items:
        raise InputError("no tensors to load", field="named_tensors")
    for name, t in items.items():
        if not isinstance(t, torch.Tensor):
            raise InputError(f"expected a torch.Tensor, got {type(t).__name__}", field=name)
    if all_names is None:
        all_names = checkpoint_names(engine.llm_engine.model_config.model)
    if changed is not None:
        items = {k: items[k] for k in expand_to_blocks(changed, items)}
        if not items:
            return EngineUpdate(tensors=0, bytes=0, stage_s=0.0, load_s=0.0,
                                total_s=time.perf_counter() - t0)
    from skyrl_numerics.invariant.numerics import check_adapters, engine_adapter_shapes, is_adapter

    adapters = [k for k in items if is_adapter(k)]
    if adapters:   # LoRA adapters of an invariant engine's plan: no fused layer, no block rule
        check_adapters({k: items[k] for k in adapters},
                       engine_adapter_shapes(engine.llm_engine.model_config.hf_config))
    if all_names and len(adapters) < len(items):
        check_complete_blocks([k for k in items if not is_adapter(k)], all_names)

    stage = tempfile.mkdtemp(prefix="skyrl_vllm_update_",
                             dir=str(staging_dir) if staging_dir else _default_staging())
    try:
        path = os.path.join(stage, _STAGING_FILE)
        with atomic_file(path) as tmp:
            save_file({k: v.detach().to("cpu").contiguous() for k, v in items.items()}, str(tmp))
        t1 = time.perf_counter()
        engine.collective_rpc("skyrl_load_weights", args=(path,))
        t2 = time.perf_counter()
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    if reset_prefix_cache:
        engine.reset_prefix_cache()
    nbytes = sum(v.numel() * v.element_size() for v in items.values())
    return EngineUpdate(tensors=len(items), bytes=nbytes, stage_s=t1 - t0, load_s=t2 - t1,
                        total_s=time.perf_counter() - t0)


def engine_linear_kernels(llm) -> dict[str, str]:
    """``{layer: "<scheme> / <kernel>"}`` of every quantized layer of a running engine (first
    worker): which kernel vLLM picked, read from the live model rather than its log."""
    engine = engine_of(llm)
    _require_extension(engine)
    return engine.collective_rpc("skyrl_linear_kernels")[0]


def engine_weight_digest(llm) -> dict[str, str]:
    """Per-parameter blake2b of the engine's weights (worker 0, vLLM's kernel layout)."""
    return engine_of(llm).collective_rpc("skyrl_weight_digest")[0]


def checkpoint_state_dict(model) -> dict[str, Any]:
    """An HF model's ``state_dict`` under the names its checkpoint (and vLLM) use.

    transformers >= 5 fuses some weights in memory (Qwen3-MoE experts become
    ``mlp.experts.gate_up_proj`` [E, 2I, H]); ``revert_weight_conversion`` splits them back into
    ``mlp.experts.<e>.{gate,up,down}_proj.weight`` as ``save_pretrained`` would.
    """
    state = dict(model.state_dict())
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers < 5: in-memory names are checkpoint names
        return state
    return dict(revert_weight_conversion(model, state))

