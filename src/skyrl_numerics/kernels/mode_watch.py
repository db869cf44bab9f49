"""What :func:`~.mode.batch_invariant_mode` does with an aten op it does not override.

An op the mode neither overrides (``mode.registered_ops``) nor lists in ``ROW_LOCAL`` below — each
group there with the reason it needs no override — is *uncovered*: its reduction order may follow
the batch. Under ``strict=True`` it raises :class:`~skyrl_numerics.errors.NotInvariant` naming the
op before it runs; otherwise it runs stock and the mode warns once per op name per process (what
it did before, no longer silently). Ops of other namespaces (collectives, custom ops) are not
judged: the mode has no table for them.

The watch is a ``TorchDispatchMode`` (:class:`Watch`) pushed by the ``with`` block on the thread
that entered it. It sees the ops that thread dispatches after autograd and autocast — the ops of
the forward and of the backward (CPU autograd runs on the calling thread) — not the ones inside
our own kernels (a dispatch mode is off while its handler runs). Other threads and
``enable_batch_invariant_cpu()`` get the kernels without the watch. While a non-infrastructure
dispatch mode is on the stack, dynamo runs every frame eagerly, compiled before or not
(``torch._dynamo.convert_frame``: "non-infra torch dispatch mode present"), so inside the block
``torch.compile``'d code runs the mode's kernels op by op (``mode.py`` says what happens elsewhere).
"""
from __future__ import annotations

import threading
import warnings

from torch.utils._python_dispatch import TorchDispatchMode

from skyrl_numerics.errors import NotInvariant

# aten ops (by base name: every overload, and the in-place form ``name_``) that run stock under the mode,
# by why a row's bits cannot depend on the batch (the trace test, tests/kernels/test_mode_trace.py,
# shows the supported families and TRL's GRPO loss reach nothing else)
ROW_LOCAL: dict[str, frozenset[str]] = {
    "no arithmetic: views, copies, factories, indexing, layout": frozenset({
        "_local_scalar_dense", "_reshape_alias", "_to_copy", "_unsafe_index", "_unsafe_view",
        "alias", "arange", "as_strided", "cat", "clone", "constant_pad_nd", "contiguous", "copy",
        "detach", "diagonal", "embedding", "empty", "empty_like", "empty_permuted", "empty_strided",
        "expand", "fill", "flip", "full", "full_like", "gather", "index", "index_select",
        "lift_fresh", "masked_fill", "masked_scatter", "masked_select", "narrow", "new_empty",
        "new_empty_strided", "new_full", "new_ones", "new_zeros", "ones", "ones_like", "permute",
        "promote_types", "repeat", "reshape", "resize", "roll", "scalar_tensor", "scatter",
        "select", "select_backward", "slice", "slice_backward", "split", "split_with_sizes",
        "squeeze", "stack", "t", "transpose", "tril", "triu", "unbind", "unsqueeze", "view",
        "where", "zero", "zeros", "zeros_like"}),
    "random draws into fresh tensors: no arithmetic across elements, the generator's stream "
    "(dropout - native_dropout, bernoulli - is not listed: its mask follows the batch)": frozenset({
        "normal", "rand", "rand_like", "randint", "randint_like", "randn", "randn_like", "randperm",
        "uniform"}),
    "exact per element: comparisons, masks, sign, abs, clamp, min/max of two, rounding, "
    "nan_to_num (TRL's vLLM importance-sampling ratio)": frozenset({
        "abs", "bitwise_and", "bitwise_not", "bitwise_or", "bitwise_xor", "ceil", "clamp",
        "clamp_max", "clamp_min", "eq", "equal", "floor", "floor_divide", "ge", "gt", "isclose",
        "isfinite", "isinf", "isnan", "le", "logical_and", "logical_not", "logical_or", "lt",
        "maximum", "minimum", "nan_to_num", "ne", "neg", "relu", "remainder", "round", "sign",
        "threshold_backward", "trunc"}),
    "exact in any order: max/min reductions, arg-max/min, sorts and top-k, counts": frozenset({
        "all", "amax", "amin", "any", "argmax", "argmin", "argsort", "bincount", "histc", "max",
        "min", "nonzero", "sort", "topk"}),
    "accumulating scatters (index_put with accumulate, scatter_add, index_add): an output element "
    "sums the inputs whose index names it, in index order (CPU: one sequential pass); the backward "
    "of gather and of indexing, each output row fed by its own token's rows":
        frozenset({"index_add", "index_put", "scatter_add"}),
    "a fixed order along the row: cumsum (CPU: one sequential scan per row, accumulated in double)":
        frozenset({"cumsum"}),
    "one IEEE operation per element (+ - * /: the same in vector body and tail)": frozenset({
        "add", "addcdiv", "addcmul", "div", "lerp", "mul", "reciprocal", "rsub", "sub"}),
    "per element, the same bits in ATen's vector body and scalar tail (tests/kernels/test_cpu_isa.py)":
        frozenset({"cos", "exp", "expm1", "log", "log1p", "pow", "sin", "sqrt", "tanh",
                   "tanh_backward"}),
    "composite of overridden ops (decomposed below the watch into _softmax)": frozenset({"_safe_softmax"}),
    "parameter-gradient sums over tokens: not per row (equal to rounding across micro-batches)":
        frozenset({"embedding_dense_backward"}),
}
ALLOWED: frozenset[str] = frozenset().union(*ROW_LOCAL.values())

_WARNED: set[str] = set()
_LOCK = threading.Lock()


def allowed(base: str) -> bool:
    """``base`` (an op name without overload) is in ``ALLOWED``, or is the in-place form
    (``name_``) of an op that is: the same arithmetic written into self."""
    return base in ALLOWED or (base.endswith("_") and base[:-1] in ALLOWED)


def op_name(func) -> str:
    """``name`` for the default overload, ``name.overload`` otherwise (as ``registered_ops``)."""
    base = func._schema.name.split("::", 1)[1]
    return base if func._overloadname == "default" else f"{base}.{func._overloadname}"


def uncovered(name: str, strict: bool) -> None:
    """Strict: raise :class:`NotInvariant` naming ``aten::name``; else warn once per name."""
    why = ("neither overridden by the mode nor listed as row-local (kernels/mode_watch.py "
           "ROW_LOCAL): its reduction order may follow the batch")
    if strict:
        raise NotInvariant(f"aten::{name}", why + "; route it through an invariant kernel or list it "
                           "with its reason")
    with _LOCK:
        if name in _WARNED:
            return
        _WARNED.add(name)
    warnings.warn(f"batch_invariant_mode: aten::{name} runs stock, {why}", RuntimeWarning, stacklevel=3)


class Watch(TorchDispatchMode):
    """Judges each aten op a thread dispatches inside the mode (module doc); ``covered`` = the
    overridden ops and ``ALLOWED``."""

    def __init__(self, covered: frozenset[str], strict: bool):
        super().__init__()
        self.covered, self.strict = covered, strict
        self._judged: dict = {}          # OpOverload -> name when uncovered, else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = self._judged.get(func, "")
        if name == "":
            name = self._judge(func)
        if name is not None:
            uncovered(name, self.strict)
        return func(*args, **(kwargs or {}))

    def _judge(self, func) -> str | None:
        if func.namespace != "aten":
            res = None
        else:
            name = op_name(func)
            res = None if (name in self.covered or allowed(name.split(".")[0])) else name
        self._judged[func] = res
        return res
