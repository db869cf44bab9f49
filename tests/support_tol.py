"""The float32 error bound the support-logprob tests compare against a float64 reference with.

With unit roundoff ``u = 2^-24`` and ``gamma_H = H u / (1 - H u)`` (any summation order of an
``H``-term dot product), a logit ``z_v = fl(fl(h . W_v) / T)`` is off by at most
``gamma_H sum_k |h_k W_vk| / T + u |z_v|``. The logprob ``z_t - logZ`` and the entropy
``logZ - sum p z`` each carry two such errors plus the rounding of the log-sum-exp over ``|S|``
terms (rescaled per chunk), bounded here by ``16 u (|S| + max |z|)``, per row.
"""
from __future__ import annotations

import torch

U32 = 2.0 ** -24


def float32_tolerance(hidden, weight, support_sets, temperature: float = 1.0) -> torch.Tensor:
    """Per-row absolute bound (float64 ``[N]``) for float32 logprobs / entropies over the supports."""
    h, w = hidden.double(), weight.double()
    H = h.shape[1]
    gamma = H * U32 / (1 - H * U32)
    out = []
    for i, ids in enumerate(support_sets):
        ids = torch.as_tensor(list(ids), dtype=torch.long)
        absdot = (h[i].abs() * w[ids].abs()).sum(-1) / temperature
        z = (h[i] * w[ids]).sum(-1) / temperature
        zerr = float((gamma * absdot + U32 * z.abs()).max())
        out.append(2 * zerr + 16 * U32 * (len(ids) + float(z.abs().max())))
    return torch.tensor(out, dtype=torch.float64)


def full_sets(n: int, vocab: int):
    return [range(vocab)] * n

