"""Batch-invariant softmax, log-softmax and token logprobs / entropy on CPU, with their
backwards: per row, every sum by :func:`.cpu_reduce.row_sum` (a fixed pairwise tree); exp, log,
amax and + - * / are per element or order-free and give an element the same bits in ATen's
vectorized body and its scalar tail (tested per ISA: ``tests/kernels/test_cpu_isa.py``).
"""
from __future__ import annotations

import torch

from ._util import compute_dtype as _compute_dtype
from .cpu_reduce import row_sum

def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """x - m - log(sum exp(x - m)) over the last dim."""
    xf = x.to(_compute_dtype(x))
    m = xf.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    s = row_sum((xf - m).exp().reshape(-1, xf.shape[-1])).reshape(m.shape)
    return (xf - m - s.log()).to(x.dtype)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """exp(x - m) / sum exp(x - m) over the last dim."""
    xf = x.to(_compute_dtype(x))
    m = xf.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = (xf - m).exp()
    s = row_sum(e.reshape(-1, xf.shape[-1])).reshape(m.shape)
    return (e / s).to(x.dtype)


def softmax_backward(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """dx = y * (g - sum(g * y))."""
    gf, yf = g.to(_compute_dtype(g)), y.to(_compute_dtype(y))
    dot = row_sum((gf * yf).reshape(-1, gf.shape[-1])).reshape(*gf.shape[:-1], 1)
    return (yf * (gf - dot)).to(y.dtype)


def log_softmax_backward(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """dx = g - exp(y) * sum(g)."""
    gf, yf = g.to(_compute_dtype(g)), y.to(_compute_dtype(y))
    total = row_sum(gf.reshape(-1, gf.shape[-1])).reshape(*gf.shape[:-1], 1)
    return (gf - yf.exp() * total).to(y.dtype)


def token_logprob_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """-> (logprob, entropy, lse) float32; entropy = log s - sum e^(z-m) (z-m) / s."""
    V = logits.shape[-1]
    z = logits.reshape(-1, V).float() / temperature
    m = z.amax(-1, keepdim=True)
    d = z - m
    e = d.exp()
    s = row_sum(e)
    u = row_sum(e * d)
    log_s = s.log()
    lse = m.squeeze(-1) + log_s
    lp = z.gather(-1, targets.reshape(-1, 1).long()).squeeze(-1) - lse
    ent = log_s - u / s
    shape = logits.shape[:-1]
    return lp.reshape(shape), ent.reshape(shape), lse


def token_logprob_entropy_backward(logits, targets, lse, ent, g_lp, g_ent, temperature: float):
    V = logits.shape[-1]
    z = logits.reshape(-1, V).float() / temperature
    logp = z - lse.unsqueeze(-1)
    p = logp.exp()
    onehot = torch.zeros_like(z).scatter_(-1, targets.reshape(-1, 1).long(), 1.0)
    glp, gent = g_lp.reshape(-1, 1).float(), g_ent.reshape(-1, 1).float()
    dz = glp * (onehot - p) - gent * p * (logp + ent.reshape(-1, 1))
    return (dz / temperature).to(logits.dtype).reshape(logits.shape)
