"""Batch-invariant CPU path (no Triton), fast enough for real use: one module per op family,
every name importable from here (``skyrl_numerics.kernels.cpu.<name>``).

Stock torch on CPU is NOT batch-invariant (measured here, torch 2.13 + MKL, 2 threads):
  * fp32 ``torch.mm``: rows of an M<=5 product differ from the same rows inside a larger M
    (MKL takes a GEMV / small-M kernel);
  * ``x.mean(-1)`` / ``x.sum(-1)`` over rows longer than 32768 differ between M=1 and M>1
    (one row is split across threads; several rows are not).
What the families do instead (each module's doc writes it out):

  * :mod:`.cpu_gemm` — matmul / bmm / grouped matmul: row blocks of exactly ``ROW_BLOCK`` rows,
    one single-threaded MKL GEMM per block, operands aligned; ``bmm`` cuts K into fixed
    ``K_CHUNK`` chunks so zero padding of K changes no bits; :func:`check_cpu_invariance`;
  * :mod:`.cpu_reduce` — :func:`row_sum` (a fixed pairwise tree, C for large inputs) and
    :func:`reduce` (sum / mean over any dims);
  * :mod:`.cpu_softmax` — softmax, log-softmax, token logprobs / entropy and their backwards;
  * :mod:`.cpu_elementwise` — per-element ops (sigmoid, silu, ...) with the vector loop's bits
    for every element;
  * :mod:`.cpu_norm`, :mod:`.cpu_attention` — RMSNorm (and the fused q/k norm + RoPE) and
    attention: every row computed on its own by a fixed sequence of binary32 operations, in C
    (``csrc/``, built by :mod:`.native`) with a bitwise-equal torch specification;
  * :mod:`.cpu_moe` — the data movement around a grouped MoE layer's GEMMs (C + specification).

Everything else used (exp, log, amax, + - * /) is per element or order-free and computes an
element's bits the same in ATen's vectorized body and its scalar tail (tested per ISA:
``tests/kernels/test_cpu_isa.py``); the ops whose tail rounds differently (sigmoid, silu, gelu,
softplus, their backwards; bf16 rsqrt) go through :func:`elementwise`.
"""
from __future__ import annotations

import torch

from . import cpu_attention, cpu_norm
from .cpu_elementwise import PIECE, VEC_ELEMS, elementwise
from .cpu_gemm import (K_CHUNK, MIN_ROWS, ROW_BLOCK, bmm, check_cpu_invariance, grouped_matmul, matmul,
                       matmul_2d, prepare_b)
from .cpu_norm import rms_norm_backward
from .cpu_reduce import SUM_BLOCK, reduce, row_sum
from .cpu_softmax import (log_softmax, log_softmax_backward, softmax, softmax_backward,
                          token_logprob_entropy, token_logprob_entropy_backward)

__all__ = [
    "MIN_ROWS", "ROW_BLOCK", "K_CHUNK", "SUM_BLOCK", "VEC_ELEMS", "PIECE",
    "prepare_b", "matmul_2d", "matmul", "bmm", "grouped_matmul", "check_cpu_invariance",
    "row_sum", "reduce", "elementwise",
    "log_softmax", "softmax", "softmax_backward", "log_softmax_backward",
    "token_logprob_entropy", "token_logprob_entropy_backward",
    "rms_norm", "rms_norm_backward", "attention",
]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6):
    """-> (y, rstd float32 per row): the fused fixed-order kernel (:mod:`.cpu_norm`; its module
    doc writes the arithmetic out). ``w`` is ``(N,)`` or one weight row per row ``(M, N)``."""
    return cpu_norm.rms_norm(x, w, eps)


def attention(q, k, v, causal: bool = True, scale: float | None = None, block_n: int = 64,
              kv_lens: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
              window: int | None = None):
    """Causal (GQA) attention, one fused fixed-order kernel per row that the trainer and the
    engine share: :func:`skyrl_numerics.kernels.cpu_attention.attention` (its module doc writes
    the arithmetic out). Token-by-token decode over a KV cache equals full prefill bit for bit,
    and a right-padded batch (``kv_lens``) gives every sequence the bits it gets alone.
    ``sinks`` (per-head logits), ``window`` (sliding window): GPT-OSS's attention."""
    return cpu_attention.attention(q, k, v, causal, scale, block_n, kv_lens, sinks, window)
