"""Beyond the sampled token: the engine's top-K logprobs per position against the trainer's.

A bitwise claim on the sampled token alone can hide a distribution that differs elsewhere. The
engine returns, per response position ``t``, its ``K`` most likely tokens with their (processed)
logprobs ``e_t[j]`` (vLLM's ``logprobs=K``); the trainer's log-softmax row ``q_t`` over the whole
vocabulary is read at the same ids. Per position:

* **bitwise**: every returned entry equals the trainer's value bit for bit,
  ``e_t[j] == q_t[id_j]``, and the returned set is the trainer's top-K — no trainer id outside it
  is larger than the smallest returned value (ties at the K-th value may fall either way);
* ``tv``: total variation of the two distributions restricted to the engine's top-K ids and
  renormalized there, ``1/2 Σ_j |p̂_j − q̂_j|`` with ``p̂ = softmax(e_t)``, ``q̂ = softmax(q_t[ids])``;
* ``kl``: ``Σ_j p̂_j (log p̂_j − log q̂_j)`` over the same ids.

:class:`TopkLogprobs` holds the engine's side (``ids`` int32 ``[T, K]``, ``values`` float32
``[T, K]``, rank order); :class:`TopkCheck` accumulates the comparison sequence by sequence, so the
trainer never holds more than one sequence's ``[r, V]`` rows (152k-vocab models included).
Multi-turn trajectories: only model tokens were sampled, so ``TopkCheck(engine, mask=loss_mask)``
compares those positions only (an observation token's row is never read; ``generate_multiturn``
stores it as ids 0, values NaN).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from skyrl_numerics.errors import InputError


@dataclass
class TopkLogprobs:
    ids: np.ndarray      # int32 [T, K], rank order (most likely first)
    values: np.ndarray   # float32 [T, K]

    def __post_init__(self):
        self.ids = np.asarray(self.ids)
        self.values = np.asarray(self.values, dtype=np.float32)
        if self.ids.ndim != 2 or self.ids.shape != self.values.shape:
            raise InputError(f"ids {self.ids.shape} and values {self.values.shape} must be the "
                             "same [positions, K]", field="topk")
        if self.ids.dtype.kind not in "iu" or (self.ids.size and self.ids.min() < 0):
            raise InputError("ids must be non-negative integers", field="topk")
        self.ids = self.ids.astype(np.int32)

    @property
    def k(self) -> int:
        return int(self.ids.shape[1])

    @classmethod
    def from_dicts(cls, rows, k: int) -> "TopkLogprobs":
        """One ``{token id: logprob}`` per position (the engine's, rank order): the ``k`` largest."""
        ids = np.zeros((len(rows), k), np.int32)
        vals = np.zeros((len(rows), k), np.float32)
        for t, d in enumerate(rows):
            items = sorted(d.items(), key=lambda kv: -float(kv[1]))[:k]   # stable: rank order
            if len(items) < k:
                raise InputError(f"{len(items)} logprobs returned for K = {k}", field="topk",
                                 index=t)
            ids[t] = [int(i) for i, _ in items]
            vals[t] = [float(v) for _, v in items]
        return cls(ids, vals)


@dataclass
class TopkCheck:
    """Accumulates :meth:`add` per sequence; :meth:`summary` gives the figures."""
    engine: TopkLogprobs
    mask: np.ndarray | None = None      # bool per position: compared where True (model tokens)
    bitwise: list = field(default_factory=list)
    tv: list = field(default_factory=list)
    kl: list = field(default_factory=list)
    first_mismatch: dict | None = None

    def add(self, start: int, logp) -> None:
        """The trainer's log-softmax rows ``[r, V]`` (numpy or torch) of positions
        ``start .. start + r - 1`` (flat response-token indices)."""
        q = np.asarray(logp.detach().float().numpy() if hasattr(logp, "detach") else logp,
                       dtype=np.float32)
        r = q.shape[0]
        ids = self.engine.ids[start:start + r]
        e = self.engine.values[start:start + r]
        if ids.shape[0] != r:
            raise InputError(f"positions {start}..{start + r - 1} beyond the engine's "
                             f"{self.engine.ids.shape[0]}", field="topk")
        pos = start + np.arange(r)
        if self.mask is not None:
            sel = np.asarray(self.mask[start:start + r], dtype=bool)
            q, ids, e, pos = q[sel], ids[sel], e[sel], pos[sel]
        qa = np.take_along_axis(q, ids, axis=1)
        same = (qa.view(np.uint32) == e.view(np.uint32)).all(axis=1)
        # the set: nothing outside it above the smallest returned value
        outside = q.copy()
        np.put_along_axis(outside, ids, -np.inf, axis=1)
        same &= outside.max(axis=1) <= e.min(axis=1)
        pe = np.exp(e - e.max(axis=1, keepdims=True))
        pe /= pe.sum(axis=1, keepdims=True)
        pq = np.exp(qa - qa.max(axis=1, keepdims=True))
        pq /= pq.sum(axis=1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            kl = np.where(pe > 0, pe * (np.log(pe) - np.log(pq)), 0.0).sum(axis=1)
        self.bitwise.append(same)
        self.tv.append(0.5 * np.abs(pe - pq).sum(axis=1))
        self.kl.append(kl)
        if self.first_mismatch is None and not same.all():
            t = int(np.argmin(same))
            bad = np.nonzero(qa[t].view(np.uint32) != e[t].view(np.uint32))[0]
            tok = int(ids[t, bad[0]]) if bad.size else int(np.argmax(outside[t]))
            self.first_mismatch = {"position": int(pos[t]), "token_id": tok}

    def summary(self) -> dict:
        b = np.concatenate(self.bitwise) if self.bitwise else np.zeros(0, bool)
        tv = np.concatenate(self.tv) if self.tv else np.zeros(0)
        kl = np.concatenate(self.kl) if self.kl else np.zeros(0)
        return {"k": self.engine.k, "positions": int(b.size),
                "frac_bitwise": float(b.mean()) if b.size else 1.0,
                "tv_mean": float(tv.mean()) if tv.size else 0.0,
                "kl_mean": float(kl.mean()) if kl.size else 0.0,
                "first_mismatch": self.first_mismatch}
