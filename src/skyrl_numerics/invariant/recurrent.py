"""What the recurrent mixers of the hybrid families share (:mod:`.qwen3_next`'s Gated DeltaNet,
:mod:`.nemotron_h`'s Mamba-2): the fixed-order causal conv, shape-independent pointwise
transcendentals, and the trainer's state rule :class:`FreshSequences`.

A hybrid family exposes ``scan(layer, inputs [B, n, C], a [B, n, H], b, conv0, S0) ->
(out [B, n, ...], conv, S)`` (the stateful part of one recurrent layer for ``B`` sequences of
``n`` new tokens), ``zero_state(B)`` and ``state_shapes()``; a state keeper (``model.recurrent``)
decides where each sequence's state comes from: here, zero at each sequence start; in the vLLM
engine, vLLM's Mamba state cache (:mod:`skyrl_numerics.engine.vllm_hybrid_state`).
"""
from __future__ import annotations

import torch

from .blocks import silu


def pointwise(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` with each element's bits independent of ``x``'s shape (CPU: every element
    through ATen's vector loop, :func:`skyrl_numerics.kernels.cpu.elementwise`)."""
    if x.device.type != "cpu":
        return fn(x)
    from skyrl_numerics.kernels import cpu

    return cpu.elementwise(fn, x)


def causal_conv(x: torch.Tensor, w: torch.Tensor, state: torch.Tensor, bias=None):
    """Depthwise causal conv + silu of ``x [B, n, C]`` after ``state [B, K-1, C]`` (the K-1
    inputs before it), taps ``w [C, K]``: ``out_t = silu(round(sum_j w_j x_{t-K+1+j} (+ bias)))``
    with the sum in fp32 in tap order (the bias last), rounded once to ``x.dtype``.
    -> ``(out [B, n, C], new state)``."""
    K = w.shape[1]
    n = x.shape[1]
    xe = torch.cat([state.to(x.dtype), x], dim=1)
    wf = w.float()
    acc = xe[:, 0:n].float() * wf[:, 0]
    for j in range(1, K):
        acc = acc + xe[:, j:j + n].float() * wf[:, j]
    if bias is not None:
        acc = acc + bias.float()
    return silu(acc.to(x.dtype)), xe[:, n:]


class FreshSequences:
    """The trainer's state rule: each run of the flat stream starting at position 0 is one
    whole sequence, scanned from zero state (``packed_hidden``'s layout)."""

    def mix(self, model, i: int, inputs, a, b, positions):
        """``model.scan`` over each sequence of the stream (``inputs [T, C]``, ``a, b [T, H]``:
        the family's per-token scan inputs) -> the outputs ``[T, ...]`` in stream order."""
        starts = torch.nonzero(positions == 0).flatten().tolist()
        if not starts or starts[0] != 0:
            starts = [0] + starts
        bounds = starts + [inputs.shape[0]]
        outs = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            conv0, S0 = model.zero_state(1)
            o, _, _ = model.scan(i, inputs[None, lo:hi], a[None, lo:hi], b[None, lo:hi], conv0, S0)
            outs.append(o[0])
        return torch.cat(outs)
