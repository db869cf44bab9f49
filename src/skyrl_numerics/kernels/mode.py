"""``batch_invariant_mode()``: route the aten ops of an unmodified model through invariant kernels.

It registers kernels for the CPU dispatch key (the fast CPU path, ``cpu.py``) and, when CUDA is
present, the CUDA key (the Triton kernels) through ``torch.library.Library("aten", "IMPL")``.
Autograd is untouched: aten's derivative formulas call mm/bmm/... again and hit the same
overrides, so backward passes are covered too.

Overridden ops, the same on both keys but for the CPU-only ones (``CPU_ONLY``, ``AUTOCAST_CPU``):

* the matmul family, every overload a trainer reaches (:mod:`.mode_matmul` writes each formula
  out): mm, addmm, bmm, baddbmm, addbmm, mv, addmv, dot, vdot, _addmm_activation and their .out
  forms; the in-place addmm_, baddbmm_, addbmm_, addmv_ (TRL's LM-head backward accumulates with
  ``acc.addmm_``); the out_dtype overloads mm/bmm/addmm/baddbmm .dtype and .dtype_out (torch has
  them on CUDA only; on the CPU key the mode provides them). matmul, linear, einsum, tensordot
  are composite and reach aten as these. And _grouped_mm (transformers' MoE experts call it;
  megatron-core's attention scores are a baddbmm);
* reductions: _log_softmax, _log_softmax_backward_data, _softmax, _softmax_backward_data,
  mean.dim, mean, sum.dim_IntList, sum (CPU: :func:`cpu.row_sum`'s fixed pairwise tree, which trailing
  zeros — a right-padded batch — do not change);
* pointwise ops whose CPU scalar tail rounds unlike their vector body (measured per ISA,
  ``tests/kernels/test_cpu_isa.py``): silu, sigmoid, gelu, softplus, rsqrt and the backwards
  silu_backward, sigmoid_backward, gelu_backward, softplus_backward (CPU: :func:`cpu.elementwise`
  computes every element in the vector body; CUDA: the stock kernel, one code path per element);
* CPU only: _scaled_dot_product_flash_attention_for_cpu and its backward, the ops
  ``scaled_dot_product_attention`` takes on CPU (:mod:`.cpu_sdpa` writes them with the kernels
  above, outputs and gradients laid out as the stock op's; the stock kernel's blocking follows the
  padded length — measured: rows of a right-padded batch differ from the same rows alone on AVX2,
  and on AVX-512 from 16 keys on). SDPA's math path (other head sizes, e.g. MLA) decomposes into
  the ops above by itself. (CUDA SDPA kernels are not covered by the mode.)
* AutocastCPU only: scaled_dot_product_attention, so that ``enable_gqa`` under CPU autocast is
  ``repeat_kv`` before the cast (:func:`.cpu_sdpa.autocast_sdpa` says why): both GQA paths of
  transformers give the same bits.

Every other aten op is judged by the watch the ``with`` block pushes (:mod:`.mode_watch`). The
ops it lists as row-local, each group with its reason (exact, per element with the same bits in
the vector body and the tail, a fixed order along the row), run stock: the supported families —
HF Qwen3-MoE, DeepSeek-V3, Mixtral, Llama — and TRL's GRPO loss reach nothing else
(``test_mode_trace.py``; the FSDP and single-process megatron-core trainer tests run strict too).
Any other raises :class:`~skyrl_numerics.errors.NotInvariant` naming it under ``strict=True``, and
otherwise runs stock with one warning per op name. Parameter gradients summed over tokens
(embedding_dense_backward, the weight gradients) agree only to rounding across micro-batch sizes:
they are sums in another association, not per-row results.

``torch.compile``: while the mode is on, the compiler's stance is ``force_eager`` (process-wide;
restored when the last holder leaves) and, inside a ``with`` block, dynamo also skips every frame
because the watch is a dispatch mode: compiled functions — compiled before the mode, inside it, or
entering it themselves — run eagerly, op by op, through the kernels above, with the bits of eager
under the mode. (Compiled, inductor would generate its own softmax and sums: measured, 11 of 56
tokens of a tiny Llama differed.)

The overrides are process-wide (the dispatcher has no per-thread table): the mode is on while
at least one holder is inside; entering/leaving is reference counted under a lock
(``patching.Refcount``), so nesting and concurrent use from threads are safe, and the stock
kernels come back when the last holder leaves. ``enable_batch_invariant_cpu()`` / ``disable_batch_invariant_cpu()`` are the same thing
without a ``with`` block, for installing in a worker process (e.g. a vLLM CPU worker) at start.
"""
from __future__ import annotations

import contextlib
import os
import warnings

import torch

from ..errors import NotInvariant
from ..patching import Refcount
from . import cpu, cpu_sdpa
from .mode_matmul import MatmulFamily
from .mode_watch import ROW_LOCAL, Watch

_LIB: torch.library.Library | None = None
_STANCE = None          # the compiler stance object while the mode is on (_eager_stance)


def _last(dim: int, nd: int) -> bool:
    return dim % max(nd, 1) == nd - 1


def _rowwise(fn, x, dim, *more):
    """Apply a last-dim row function along ``dim`` (moving it last and back)."""
    if _last(dim, x.dim()):
        return fn(x, *more)
    xt = x.movedim(dim, -1)
    out = fn(xt, *(t.movedim(dim, -1) for t in more))
    return out.movedim(-1, dim).contiguous()


# --------------------------------------------------------------------------- CPU kernels
def _cpu_mm(a, b, out_dtype):
    """The CPU key's matmul primitive (``mode_matmul``): :func:`cpu.matmul_2d`, looked up per call."""
    return cpu.matmul_2d(a, b, None, out_dtype)


def _cpu_bmm(a, b, out_dtype):
    return cpu.bmm(a, b, out_dtype)


def _cpu_grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
    """aten::_grouped_mm (what transformers' MoE experts call): a (S, K) sorted by group,
    b (G, K, N), offs (G,) cumulative row ends; a (G, M, K) @ b (G, K, N) without offs; or, in
    the backward, a (K, S) @ b (S, N) grouped along S -> (G, K, N)."""
    if a.dim() == 2 and b.dim() == 3 and offs is not None:
        ends = offs.to(torch.int64).cpu()
        full = torch.cat([ends.new_zeros(1), ends])
        rows = int(full[-1])
        out = torch.zeros((a.shape[0], b.shape[2]), dtype=out_dtype or a.dtype)
        out[:rows] = cpu.grouped_matmul(a[:rows], b, full).to(out.dtype)
    elif a.dim() == 3 and b.dim() == 3 and offs is None:
        out = cpu.bmm(a, b).to(out_dtype or a.dtype)
    elif a.dim() == 2 and b.dim() == 2 and offs is not None:
        # the expert-weight gradient: a (K, S) @ b (S, N) per group of the shared S axis
        # (offs = cumulative ends); out[g] = a[:, s_g:e_g] @ b[s_g:e_g], zeros for empty groups
        ends = offs.to(torch.int64).cpu().tolist()
        out = torch.zeros((len(ends), a.shape[0], b.shape[1]), dtype=out_dtype or a.dtype)
        start = 0
        for g, end in enumerate(ends):
            if end > start:
                out[g] = cpu.matmul_2d(a[:, start:end], b[start:end]).to(out.dtype)
            start = end
    else:
        raise NotImplementedError(f"batch-invariant _grouped_mm: {a.dim()}D x {b.dim()}D"
                                  f"{' with' if offs is not None else ' without'} offs")
    return out if bias is None else out + bias


def _cpu_log_softmax(x, dim, half_to_float):
    out = _rowwise(cpu.log_softmax, x.float() if half_to_float else x, dim)
    return out


def _cpu_log_softmax_bwd(g, y, dim, input_dtype):
    return _rowwise(lambda gg, yy: cpu.log_softmax_backward(gg, yy), g, dim, y).to(input_dtype)


def _cpu_softmax(x, dim, half_to_float):
    return _rowwise(cpu.softmax, x.float() if half_to_float else x, dim)


def _cpu_softmax_bwd(g, y, dim, input_dtype):
    return _rowwise(lambda gg, yy: cpu.softmax_backward(gg, yy), g, dim, y).to(input_dtype)


def _cpu_mean(x, dim=None, keepdim=False, *, dtype=None):
    if not x.is_floating_point():
        raise RuntimeError(f"mean(): expected a floating point input, got {x.dtype}")
    dims = list(dim) if dim is not None else None
    return cpu.reduce(x if dtype is None else x.to(dtype), dims, keepdim, True, dtype)


def _cpu_sum(x, dim=None, keepdim=False, *, dtype=None):
    return cpu.reduce(x if dtype is None else x.to(dtype), list(dim) if dim is not None else None,
                      keepdim, False, dtype)


def _cpu_sum_all(x, *, dtype=None):
    return _cpu_sum(x, None, False, dtype=dtype)


def _pointwise(out_op, n_in: int):
    """An override computing ``out_op`` (the op's stock ``.out`` / ``.grad_input`` kernel, which
    the override does not replace) through :func:`cpu.elementwise` on the first ``n_in`` tensor
    arguments; the rest are passed as they are."""
    def impl(*args, **kwargs):
        ts, rest = args[:n_in], args[n_in:]
        dt = torch.result_type(*ts) if n_in > 1 else ts[0].dtype

        def run(*pieces):
            res = torch.empty(pieces[0].shape, dtype=dt)
            return out_op(*pieces, *rest, **kwargs, **{_OUT_NAME[out_op]: res})
        return cpu.elementwise(run, *ts)
    return impl


_A = torch.ops.aten
_OUT_NAME = {_A.silu.out: "out", _A.sigmoid.out: "out", _A.gelu.out: "out", _A.softplus.out: "out",
             _A.rsqrt.out: "out", _A.silu_backward.grad_input: "grad_input",
             _A.sigmoid_backward.grad_input: "grad_input", _A.gelu_backward.grad_input: "grad_input",
             _A.softplus_backward.grad_input: "grad_input"}
_POINTWISE = {"silu": (_A.silu.out, 1), "sigmoid": (_A.sigmoid.out, 1), "gelu": (_A.gelu.out, 1),
              "softplus": (_A.softplus.out, 1), "rsqrt": (_A.rsqrt.out, 1),
              "silu_backward": (_A.silu_backward.grad_input, 2),
              "sigmoid_backward": (_A.sigmoid_backward.grad_input, 2),
              "gelu_backward": (_A.gelu_backward.grad_input, 2),
              "softplus_backward": (_A.softplus_backward.grad_input, 2)}


def _stock_pointwise(out_op, n_in: int):
    """CUDA: the stock kernel through its ``.out`` form (one code path for every element)."""
    def impl(*args, **kwargs):
        ts = args[:n_in]
        dt = torch.result_type(*ts) if n_in > 1 else ts[0].dtype
        shape = torch.broadcast_shapes(*(t.shape for t in ts))
        res = torch.empty(shape, dtype=dt, device=ts[0].device)
        return out_op(*args, **kwargs, **{_OUT_NAME[out_op]: res})
    return impl


# --------------------------------------------------------------------------- CUDA kernels
def _cuda_kernels() -> dict:
    """The CUDA-key table: the same ops as ``_CPU_KERNELS``, built from the Triton kernels.

    Imports Triton (not CUDA): the table can be built and registered on a machine without a GPU
    (``_install(cuda=True)``), which is how the tests inspect it."""
    from . import tl_matmul, tl_reduce, tl_softmax

    def mm(a, b, out_dtype):
        return tl_matmul.matmul(a, b, out_dtype=out_dtype)

    def bmm(a, b, out_dtype):
        return tl_matmul.bmm(a, b, out_dtype=out_dtype)

    def grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
        """aten::_grouped_mm, the three layouts of ``_cpu_grouped_mm``."""
        dt = out_dtype or a.dtype
        if a.dim() == 2 and b.dim() == 3 and offs is not None:
            # offs = cumulative row ends; rows past offs[-1] belong to no group and stay zero
            # (the kernel only stores rows inside a group's segment): no host sync needed
            full = torch.cat([offs.new_zeros(1), offs]).to(device=a.device, dtype=torch.int32)
            out = tl_matmul.grouped_matmul(a, b, full).to(dt)
        elif a.dim() == 3 and b.dim() == 3 and offs is None:
            out = tl_matmul.bmm(a, b).to(dt)
        elif a.dim() == 2 and b.dim() == 2 and offs is not None:
            # the expert-weight gradient: out[g] = a[:, s_g:e_g] @ b[s_g:e_g], zeros for empty groups
            ends = offs.to(torch.int64).cpu().tolist()
            out = torch.zeros((len(ends), a.shape[0], b.shape[1]), dtype=dt, device=a.device)
            start = 0
            for g, end in enumerate(ends):
                if end > start:
                    out[g] = tl_matmul.matmul(a[:, start:end], b[start:end]).to(dt)
                start = end
        else:
            raise NotImplementedError(f"batch-invariant _grouped_mm: {a.dim()}D x {b.dim()}D"
                                      f"{' with' if offs is not None else ' without'} offs")
        return out if bias is None else out + bias

    def log_softmax(x, dim, half_to_float):
        return _rowwise(tl_softmax.log_softmax_fwd, x.float() if half_to_float else x, dim)

    def log_softmax_bwd(g, y, dim, input_dtype):
        return _rowwise(tl_softmax.log_softmax_bwd, g, dim, y).to(input_dtype)

    def softmax(x, dim, half_to_float):
        """exp(x - m) / sum exp(x - m) in fp32 (``cpu.softmax``'s formula): the max is exact in
        any order, the sum is the Triton row reduction (fixed chunk order)."""
        xf = x.float()
        m = xf.amax(dim, keepdim=True)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        e = (xf - m).exp()
        y = e / tl_reduce.reduce(e, [dim], True, False)
        return y if half_to_float else y.to(x.dtype)

    def softmax_bwd(g, y, dim, input_dtype):
        """dx = y * (g - sum(g * y)), the sum in fixed order."""
        gf, yf = g.float(), y.float()
        dot = tl_reduce.reduce(gf * yf, [dim], True, False)
        return (yf * (gf - dot)).to(input_dtype)

    def mean(x, dim=None, keepdim=False, *, dtype=None):
        if not x.is_floating_point():
            raise RuntimeError(f"mean(): expected a floating point input, got {x.dtype}")
        return tl_reduce.reduce(x if dtype is None else x.to(dtype),
                                list(dim) if dim is not None else None, keepdim, True, dtype)

    def sum_(x, dim=None, keepdim=False, *, dtype=None):
        """Floating sums: the Triton row reduction; integer sums are exact in any order."""
        if not (x if dtype is None else x.to(dtype)).is_floating_point():
            res = torch.empty(0, dtype=dtype or torch.int64, device=x.device)
            return _A.sum.IntList_out(x, dim, keepdim, dtype=dtype, out=res)
        return tl_reduce.reduce(x if dtype is None else x.to(dtype),
                                list(dim) if dim is not None else None, keepdim, False, dtype)

    return {**MatmulFamily(mm, bmm).table(),
            "_log_softmax": log_softmax, "_log_softmax_backward_data": log_softmax_bwd,
            "_softmax": softmax, "_softmax_backward_data": softmax_bwd, "mean.dim": mean,
            "_grouped_mm": grouped_mm,
            "sum.dim_IntList": sum_, "sum": lambda x, *, dtype=None: sum_(x, None, False, dtype=dtype),
            "mean": lambda x, *, dtype=None: mean(x, None, False, dtype=dtype),
            **{op: _stock_pointwise(*spec) for op, spec in _POINTWISE.items()}}


_CPU_KERNELS = {
    **MatmulFamily(_cpu_mm, _cpu_bmm).table(),
    "_log_softmax": _cpu_log_softmax, "_log_softmax_backward_data": _cpu_log_softmax_bwd,
    "_softmax": _cpu_softmax, "_softmax_backward_data": _cpu_softmax_bwd, "mean.dim": _cpu_mean,
    "_grouped_mm": _cpu_grouped_mm,
    "sum.dim_IntList": _cpu_sum, "sum": _cpu_sum_all,
    "mean": lambda x, *, dtype=None: _cpu_mean(x, None, False, dtype=dtype),
    **{op: _pointwise(*spec) for op, spec in _POINTWISE.items()},
    "_scaled_dot_product_flash_attention_for_cpu": cpu_sdpa.flash_attention_for_cpu,
    "_scaled_dot_product_flash_attention_for_cpu_backward": cpu_sdpa.flash_attention_for_cpu_backward,
}
CPU_ONLY = frozenset({"_scaled_dot_product_flash_attention_for_cpu",
                      "_scaled_dot_product_flash_attention_for_cpu_backward"})
# the AutocastCPU key (above autograd): CPU autocast's SDPA, with enable_gqa as repeat_kv
_AUTOCAST_CPU_KERNELS = {"scaled_dot_product_attention": cpu_sdpa.autocast_sdpa}
AUTOCAST_CPU = frozenset(_AUTOCAST_CPU_KERNELS)


def _install(cuda: bool | None = None) -> torch.library.Library:
    """Register the CPU table and (``cuda``; default: when CUDA is available) the CUDA table.
    Both tables hold the same ops (``registered_ops``)."""
    if cuda is None:
        cuda = torch.cuda.is_available()
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": intended
        warnings.simplefilter("ignore", UserWarning)
        for op, fn in _CPU_KERNELS.items():
            lib.impl(op, fn, "CPU")
        for op, fn in _AUTOCAST_CPU_KERNELS.items():
            lib.impl(op, fn, "AutocastCPU")
        if cuda:
            for op, fn in _cuda_kernels().items():
                lib.impl(op, fn, "CUDA")
    return lib


def registered_ops(device: str = "cpu") -> tuple[str, ...]:
    """The aten ops (``name`` or ``name.overload``) the mode overrides for ``device`` ("cpu" or
    "cuda"); building the CUDA table imports Triton, not CUDA."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return tuple(sorted(_CPU_KERNELS if device == "cpu" else _cuda_kernels()))


def op_table(device: str = "cpu") -> dict[str, str]:
    """What the mode runs, as names: ``{aten op: "module.qualname" of its kernel}`` for
    ``device`` ("cpu" also lists the AutocastCPU entries as ``"AutocastCPU:<op>"``), plus
    ``"row_local:<group>"`` -> the sorted ops :mod:`.mode_watch` lets run stock. The execution
    contract (``invariant/contract.py``) hashes it: another table is another forward."""
    table = _CPU_KERNELS if device == "cpu" else _cuda_kernels()
    out = {op: _kernel_name(fn) for op, fn in table.items()}
    if device == "cpu":
        out.update({f"AutocastCPU:{op}": _kernel_name(fn) for op, fn in _AUTOCAST_CPU_KERNELS.items()})
    out.update({f"row_local:{g}": ",".join(sorted(ops)) for g, ops in ROW_LOCAL.items()})
    return out


def _kernel_name(fn) -> str:
    inner = getattr(fn, "func", fn)            # functools.partial
    return f"{getattr(inner, '__module__', '?')}.{getattr(inner, '__qualname__', type(inner).__name__)}"


@torch.compiler.disable
def _eager_stance():
    """``torch.compiler.set_stance("force_eager")`` (its object restores the prior stance on
    ``__exit__``): while the mode is on, compiled functions run eagerly, op by op, through the
    mode's kernels — on every thread, compiled before or not. Inductor would otherwise generate
    its own softmax and sums (measured: 11 of 56 tokens of a tiny Llama differed from eager under
    the mode). Run outside dynamo (``torch.compiler.disable``), so a compiled function may enter
    the mode too; should torch refuse the change, the mode refuses, naming torch.compile."""
    try:
        return torch.compiler.set_stance("force_eager")
    except RuntimeError as e:
        raise NotInvariant("torch.compile", f"the mode cannot be entered inside a compiled region "
                           f"({e}); enter it around the compiled call") from None


@torch.compiler.disable
def _restore_stance(stance) -> None:
    stance.__exit__(None, None, None)


def _register() -> None:
    global _LIB, _STANCE
    _STANCE = _eager_stance()
    _LIB = _install()


def _unregister() -> None:
    global _LIB, _STANCE
    if _LIB is not None:
        _LIB._destroy()
        _LIB = None
    if _STANCE is not None:
        _restore_stance(_STANCE)
        _STANCE = None


# on while at least one holder is inside (patching.Refcount: nested and threaded use)
_MODE = Refcount("batch-invariant mode", on=_register, off=_unregister)
STRICT_ENV = "SKYRL_NUMERICS_MODE_STRICT"


def is_batch_invariant_mode_enabled() -> bool:
    return _MODE.active()


def default_strict() -> bool:
    """``strict`` when the caller does not say: ``SKYRL_NUMERICS_MODE_STRICT=1`` (the project's
    tests set it) makes it True; default False."""
    return os.environ.get(STRICT_ENV, "0") not in ("", "0")


@contextlib.contextmanager
def batch_invariant_mode(strict: bool | None = None):
    """Within the block, the ops of :func:`registered_ops` (GEMMs in every form, softmax and
    sums, the pointwise ops with a scalar tail, CPU SDPA) run batch-invariant kernels, and every
    other aten op this thread dispatches is judged (:mod:`.mode_watch`): row-local ones run stock;
    an uncovered one raises :class:`NotInvariant` naming it when ``strict`` (default:
    :func:`default_strict`), else runs stock with one warning per op name."""
    strict = default_strict() if strict is None else bool(strict)
    with _MODE.held(), Watch(frozenset(_CPU_KERNELS), strict):
        yield


def enable_batch_invariant_cpu() -> None:
    """Turn the mode on for the whole process (e.g. at vLLM CPU worker start). Idempotent per
    call pair: each call must be matched by :func:`disable_batch_invariant_cpu` to turn it off."""
    _MODE.acquire()


def disable_batch_invariant_cpu() -> None:
    """Undo one :func:`enable_batch_invariant_cpu`; one too many raises ``PatchError`` (a
    ``RuntimeError``)."""
    _MODE.release(strict=True)
