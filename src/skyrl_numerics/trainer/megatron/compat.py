"""CPU compatibility for megatron-core 0.16.1 — the one place that patches megatron-core/torch, and only
when CUDA is absent (``torch.cuda.is_available()`` is False; with CUDA :func:`install` does nothing).

megatron-core's GPT/MoE path assumes a CUDA device in a handful of calls. Each patch below replaces one of
them with its CPU meaning, for as long as the compatibility is installed (:func:`cpu_compat` context
manager, or :func:`install` / :func:`uninstall`, reference-counted). :func:`uninstall` puts every original
object back, through the project's patch registry (``skyrl_numerics.patching``: a name megatron-core never
bound is deleted again; :func:`patches` lists what is in place; tested in
``tests/trainer/test_megatron_model.py``). Nothing else in the project patches
megatron-core. A model built under the compatibility must also *run* under it; it may be installed
around each call (``MegatronTrainer`` and ``MegatronPolicy.hidden`` do: the patches are in place only while
megatron-core code runs, never while, e.g., a vLLM engine runs in the same process).

What is covered, who calls it, and why:

``torch.cuda.current_device`` -> ``torch.device("cpu")``
    ``TopKRouter.gating`` moves the router weight/bias to it on every forward
    (``moe/router.py``); ``DotProductAttention`` allocates the softmax offset on it;
    ``tensor_parallel.mappings`` (sequence-parallel gather / reduce-scatter buffers) and
    ``tensor_parallel.layers`` (weight allocation without ``use_cpu_initialization``, the
    sequence-parallel all-gather buffer in the linear's autograd function), ``GroupedMLP`` /
    ``SequentialMLP`` allocations; router aux-loss buffers. On CPU the "current device" is the CPU.
``torch.cuda.Stream``, ``torch.cuda.current_stream``, ``torch.cuda.stream``, ``torch.cuda.Event``
    ``MoEAlltoAllTokenDispatcher.__init__`` creates a side stream (class attribute
    ``cuda_dtoh_stream``) and ``_maybe_dtoh_and_synchronize`` waits on / switches to / records events
    on it to overlap device-to-host copies of the split sizes. CPU work is synchronous: a stand-in
    stream whose waits, records and synchronizes are no-ops is exact. The class attribute is set to a
    stand-in while installed and reset on uninstall.
``torch.cuda.synchronize``
    no-op (CPU work is synchronous).
``token_dispatcher.maybe_move_tensor_to_cpu``
    on CUDA it copies the alltoall split sizes to the host and, with ``as_numpy=True``, returns numpy
    arrays, which ``torch.distributed.all_to_all_single`` takes as split lists. It leaves tensors that are
    already on the CPU untouched, so on CPU the splits stay tensors and ``all_to_all_single`` rejects them
    (``TypeError: incompatible function arguments``). The stand-in returns the same numpy arrays on CPU.
``torch.cuda.get_rng_state``, ``torch.cuda.manual_seed``,
``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``
    the ``CudaRNGStatesTracker`` (``model_parallel_cuda_manual_seed``, ``get_cuda_rng_tracker().fork()``,
    entered by ``DotProductAttention`` around attention dropout and by weight initialization) saves,
    seeds and restores *the CUDA generator*. The generator that drives CPU tensors is the CPU default
    generator, so these read/seed/set that one. Semantics kept: each tracked state (data-, tensor-,
    expert-parallel) is its own stream and ``fork`` restores the outer state on exit.
``fused_softmax.get_default_causal_mask`` / ``get_sliding_window_causal_mask``
    the un-fused softmax builds its causal mask with ``device="cuda"`` (``transformer/utils.py``); the
    CPU versions build the same boolean masks on the CPU.
``moe_utils.te_general_gemm`` -> ``None``
    not CUDA, but a CPU-only fact: without Transformer Engine (a CUDA package) megatron-core 0.16.1
    never binds this name, and ``RouterGatingLinearFunction`` raises ``NameError`` on it; ``None``
    selects megatron's own ``torch.mm`` branch.
``multi_latent_attention.HAVE_TE`` -> ``False`` (only where Transformer Engine is absent)
    not CUDA, but a CPU-only fact again: ``megatron.core.extensions.transformer_engine`` imports without TE
    and binds ``TELinear`` to a ``MagicMock``, so MLA's ``HAVE_TE`` is True and
    ``isinstance(self.linear_proj, TELinear)`` raises ``TypeError`` while building ``MLASelfAttention``.
``grouped_gemm_util.grouped_gemm`` / ``.ops`` (only where the ``grouped_gemm`` CUDA extension is
absent)
    the legacy ``GroupedMLP`` (``moe_grouped_gemm=True`` without Transformer Engine) calls
    ``grouped_gemm.ops.gmm(x, w, tokens_per_expert, trans_b)``, a CUDA-only extension. The stand-in
    computes each expert's rows with one ``torch.mm`` (the same products, in expert order).
What this does not do: CUDA graphs, Transformer Engine layers, fused kernels (apex, ``moe_permute_fusion``,
``bias_activation_fusion``, ``masked_softmax_fusion``, ``apply_rope_fusion``, flash attention) — keep those
off in the config (:func:`skyrl_numerics.trainer.megatron.model.transformer_config` does). Not needed on
torch 2.13: gloo runs megatron's ``all_gather_into_tensor``, ``reduce_scatter_tensor`` and
``all_to_all_single`` (sequence parallelism, alltoall dispatch) as they are. megatron-core's own
``WrappedTorchNorm`` refuses sequence parallelism; that is not patched — the layer spec uses
:class:`skyrl_numerics.trainer.megatron.model.RMSNorm` instead.
"""
from __future__ import annotations

import contextlib
from collections import Counter

import torch

from ...patching import PatchSet

__all__ = ["cpu_compat", "install", "uninstall", "installed", "needed", "calls", "patches"]

_calls: Counter = Counter()


class _CpuEvent:
    """A CUDA event on a synchronous device: complete when recorded."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        _calls["Event.record"] += 1

    def wait(self, stream=None):
        pass

    def synchronize(self):
        _calls["Event.synchronize"] += 1

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class _CpuStream:
    """A CUDA stream on a synchronous device: every wait / record / synchronize is a no-op."""

    def __init__(self, *args, **kwargs):
        _calls["Stream"] += 1

    def wait_stream(self, other):
        _calls["Stream.wait_stream"] += 1

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        _calls["Stream.record_event"] += 1
        return event if event is not None else _CpuEvent()

    def synchronize(self):
        pass

    def query(self):
        return True

    # one device, one queue: every stand-in stream is "the same" stream
    def __eq__(self, other):
        return isinstance(other, _CpuStream)

    def __hash__(self):
        return hash(_CpuStream)


_DEFAULT_STREAM = _CpuStream.__new__(_CpuStream)


def _current_device():
    _calls["current_device"] += 1
    return torch.device("cpu")


def _current_stream(device=None):
    _calls["current_stream"] += 1
    return _DEFAULT_STREAM


def _stream(stream=None):
    _calls["stream"] += 1
    return contextlib.nullcontext(stream)


def _synchronize(device=None):
    _calls["synchronize"] += 1


def _get_rng_state(device="cuda"):
    _calls["get_rng_state"] += 1
    return torch.get_rng_state()


def _manual_seed(seed):
    _calls["manual_seed"] += 1
    torch.manual_seed(int(seed))


def _mc_get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
    _calls["_get_cuda_rng_state"] += 1
    if graph_safe:
        raise RuntimeError("graph-safe (CUDA-graph) RNG states have no CPU equivalent")
    return torch.get_rng_state()


def _mc_set_cuda_rng_state(new_state, device=-1, graph_safe=False):
    _calls["_set_cuda_rng_state"] += 1
    if graph_safe:
        raise RuntimeError("graph-safe (CUDA-graph) RNG states have no CPU equivalent")
    torch.set_rng_state(new_state)


def _maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
    if torch.is_tensor(tensor) and as_numpy:
        _calls["maybe_move_tensor_to_cpu"] += 1
        return tensor.detach().cpu().numpy()
    return tensor


def _causal_mask(sq: int) -> torch.Tensor:
    _calls["get_default_causal_mask"] += 1
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _sliding_window_mask(sq, skv, window_size):
    _calls["get_sliding_window_causal_mask"] += 1
    m = torch.ones(sq, skv, dtype=torch.bool)
    mu = torch.triu(m, diagonal=skv - sq - window_size[0])
    return ~torch.tril(mu, diagonal=skv - sq + window_size[1])


class _GroupedGemmOps:
    """``grouped_gemm.ops`` on CPU: ``gmm(a [T, K], b [E, K, N] (or [E, N, K] with trans_b), batch_sizes [E])``."""

    @staticmethod
    def gmm(a, b, batch_sizes, trans_b=False):
        _calls["gmm"] += 1
        sizes = [int(s) for s in torch.as_tensor(batch_sizes).tolist()]
        outs, start = [], 0
        for e, n in enumerate(sizes):
            w = b[e].t() if trans_b else b[e]
            outs.append(a[start:start + n] @ w)
            start += n
        if not outs:
            return a.new_zeros(0, b.shape[-2] if trans_b else b.shape[-1])
        return torch.cat(outs, dim=0)


class _GroupedGemmModule:
    ops = _GroupedGemmOps


def needed() -> bool:
    """True when the compatibility applies (no CUDA in this torch / on this machine)."""
    return not torch.cuda.is_available()


def installed() -> bool:
    return _PATCHES.installed()


def calls() -> dict[str, int]:
    """How often each stand-in ran since the last :func:`install` from depth 0 (for tests / debugging)."""
    return dict(_calls)


def patches() -> list[str]:
    """``owner.attribute`` of every patch in place, in the order applied (empty when not installed)."""
    return [p.where for p in _PATCHES.patches()]


def _apply():
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.tensor_parallel.random as mc_random
    import megatron.core.transformer.moe.grouped_gemm_util as gg
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    _calls.clear()
    patch = _PATCHES.set
    cuda = torch.cuda
    patch(cuda, "current_device", _current_device)
    patch(cuda, "Stream", _CpuStream)
    patch(cuda, "Event", _CpuEvent)
    patch(cuda, "current_stream", _current_stream)
    patch(cuda, "stream", _stream)
    patch(cuda, "synchronize", _synchronize)
    patch(cuda, "get_rng_state", _get_rng_state)
    patch(cuda, "manual_seed", _manual_seed)
    patch(mc_random, "_get_cuda_rng_state", _mc_get_cuda_rng_state)
    patch(mc_random, "_set_cuda_rng_state", _mc_set_cuda_rng_state)
    patch(fused_softmax, "get_default_causal_mask", _causal_mask)
    patch(fused_softmax, "get_sliding_window_causal_mask", _sliding_window_mask)
    if getattr(moe_utils, "te_general_gemm", None) is None:
        patch(moe_utils, "te_general_gemm", None, create=True)
    import megatron.core.extensions.transformer_engine as te_ext
    import megatron.core.transformer.multi_latent_attention as mla

    if not getattr(te_ext, "HAVE_TE", False) and getattr(mla, "HAVE_TE", False):
        patch(mla, "HAVE_TE", False)
    if gg.grouped_gemm is None:
        patch(gg, "grouped_gemm", _GroupedGemmModule)
        patch(gg, "ops", _GroupedGemmOps)
    patch(token_dispatcher, "maybe_move_tensor_to_cpu", _maybe_move_tensor_to_cpu)
    # a stand-in stream (not None): dispatchers built under an earlier install keep working in later ones
    patch(token_dispatcher.MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", _DEFAULT_STREAM)


# megatron-core's CUDA assumptions, replaced for as long as the compatibility is installed
_PATCHES = PatchSet("megatron compat", _apply)


def install() -> bool:
    """Install the CPU compatibility (reference-counted); returns whether it is active.

    A no-op returning False when CUDA is available. Every :func:`install` that returned True needs one
    :func:`uninstall`.
    """
    if not needed():
        return False
    _PATCHES.install()
    return True


def uninstall() -> None:
    """Undo one :func:`install`; the last one restores every original object."""
    _PATCHES.uninstall()


@contextlib.contextmanager
def cpu_compat():
    """``with cpu_compat(): build and run a megatron-core model on CPU`` (nothing happens with CUDA)."""
    active = install()
    try:
        yield active
    finally:
        if active:
            uninstall()
