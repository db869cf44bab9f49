"""skyrl_numerics.kernels — batch-invariant kernels.

Every op here computes each output row with a reduction order that does not depend on how
many other rows share the batch (nor, for attention, on prefill vs decode). Triton kernels run
on CUDA (imported lazily: importing this package does not import Triton); on CPU a fast path
built from stock torch ops gives the same guarantee. ``batch_invariant_mode()`` routes the aten
ops of an unmodified model (mm, addmm, bmm, _log_softmax, mean, ...) through them.

    from skyrl_numerics.kernels import batch_invariant_mode, matmul, token_logprob_entropy
    with batch_invariant_mode():
        logits = model(input_ids).logits     # row i identical for any batch size
"""

from .mode import (batch_invariant_mode, disable_batch_invariant_cpu, enable_batch_invariant_cpu,
                   is_batch_invariant_mode_enabled)
from .ops import (attention, bmm, grouped_matmul, log_softmax, matmul, mean, rms_norm,
                  stock_backward, sum, token_logprob_entropy)
from .cpu import check_cpu_invariance

__all__ = [
    "batch_invariant_mode", "enable_batch_invariant_cpu", "disable_batch_invariant_cpu",
    "is_batch_invariant_mode_enabled", "check_cpu_invariance",
    "matmul", "bmm", "grouped_matmul", "log_softmax", "token_logprob_entropy", "rms_norm",
    "mean", "sum", "attention", "stock_backward",
]
