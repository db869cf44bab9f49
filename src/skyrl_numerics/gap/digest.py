"""The full distribution, bitwise: a digest of the engine's whole logits row per response position
against the trainer's.

The top-K check (:mod:`.topk`) compares ``K`` entries per position; this compares all ``V``,
cheaply: the engine hashes each row where it computes it and sends back 16 bytes per position.

**What is hashed.** For response token ``t`` (at sequence position ``p``) the row is the model's
*raw* logits for position ``p`` — the lm-head output on the hidden state of position ``p - 1``,
vLLM's ``model.compute_logits`` row that its ``Sampler`` receives — converted to float32 exactly
as the sampler's first step does (``logits.to(torch.float32)``; bf16 → fp32 is exact), before
anything the sampler applies after that: no logits processors, penalties, temperature, top-k /
top-p or log-softmax. Temperature therefore does not enter the digest (greedy and any temperature
hash the same row). The trainer side is the invariant forward's ``model.logits(h).float()``, the
tensor its logprobs divide by the temperature (``invariant/base.py``). The bytes hashed are the
row's ``V`` float32 values in vocabulary order, little-endian, C-contiguous (a strided or
transposed view hashes the same as its contiguous copy); ``-0.0``, ``+0.0`` and NaN payloads are
different bits and so different rows.

**Digest.** :data:`DIGEST_BYTES` (16) bytes of ``xxh3-128`` when ``xxhash`` imports, else
``blake2b-128`` (:mod:`skyrl_numerics.hashing`); the engine records the algorithm it used and the
trainer uses the same one. Equal digests mean equal rows unless a 128-bit collision occurs; any
difference means at least one bit of one logit differs — which one a digest cannot say, so the
first differing *token id* needs the engine's row itself (:meth:`DigestCheck.name_token`).

:class:`LogitsDigests` holds the engine's side (``[T, 16]`` uint8, ``Rollout.logits_digest``);
:class:`DigestCheck` accumulates the comparison sequence by sequence. Multi-turn trajectories:
observation tokens are not sampled, so ``DigestCheck(engine, mask=loss_mask)`` compares model
tokens only (``generate_multiturn`` stores zero digests at observation tokens).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from skyrl_numerics.errors import InputError
from skyrl_numerics.hashing import DIGEST_ALGOS, default_algo, hasher

DIGEST_BYTES = 16

__all__ = ["DIGEST_BYTES", "row_digest", "row_digests", "LogitsDigests", "DigestCheck",
           "first_differing_id", "default_algo"]


def _fp32_rows(rows) -> np.ndarray:
    """``rows`` (torch or numpy, ``[n, V]`` or ``[V]``) as a C-contiguous float32 numpy array
    ``[n, V]``; a float type other than float32 is converted (bf16/fp16 exactly)."""
    if hasattr(rows, "detach"):
        import torch

        t = rows.detach()
        if t.dtype != torch.float32:
            t = t.to(torch.float32)
        rows = t.cpu().contiguous().numpy()
    a = np.asarray(rows)
    if a.dtype.kind != "f":
        raise InputError(f"logits rows must be floating point, got {a.dtype}", field="logits")
    a = np.ascontiguousarray(a, dtype=np.float32)
    if a.ndim == 1:
        a = a[None]
    if a.ndim != 2:
        raise InputError(f"logits rows must be [positions, vocab], got shape {a.shape}",
                         field="logits")
    return a


def row_digest(row, algo: str) -> bytes:
    """The :data:`DIGEST_BYTES`-byte digest of one float32 logits row ``[V]`` (see the module)."""
    a = _fp32_rows(row)
    if a.shape[0] != 1:
        raise InputError(f"one row expected, got {a.shape[0]}", field="logits")
    h = hasher(algo)
    h.update(a[0].astype("<f4", copy=False).tobytes())
    return h.digest()


def row_digests(rows, algo: str) -> np.ndarray:
    """Digests of every row of ``rows`` ``[n, V]``: uint8 ``[n, 16]``."""
    a = _fp32_rows(rows).astype("<f4", copy=False)
    out = np.empty((a.shape[0], DIGEST_BYTES), np.uint8)
    for i in range(a.shape[0]):
        h = hasher(algo)
        h.update(a[i].data)
        out[i] = np.frombuffer(h.digest(), np.uint8)
    return out


def first_differing_id(engine_row, trainer_row) -> int | None:
    """The smallest token id whose float32 bits differ between two rows (``None``: identical)."""
    e, t = _fp32_rows(engine_row)[0], _fp32_rows(trainer_row)[0]
    if e.shape != t.shape:
        raise InputError(f"engine row has {e.shape[0]} logits, trainer row {t.shape[0]}",
                         field="logits")
    bad = np.flatnonzero(e.view(np.uint32) != t.view(np.uint32))
    return int(bad[0]) if bad.size else None


@dataclass
class LogitsDigests:
    """The engine's digests, one per response token (flat, the rollout's order)."""
    digests: np.ndarray     # uint8 [T, DIGEST_BYTES]
    algo: str

    def __post_init__(self):
        if self.algo not in DIGEST_ALGOS:
            raise InputError(f"unknown digest algorithm {self.algo!r} (known: {DIGEST_ALGOS})",
                             field="logits_digest")
        d = np.asarray(self.digests)
        if d.dtype != np.uint8 or d.ndim != 2 or d.shape[1] != DIGEST_BYTES:
            raise InputError(f"digests must be uint8 [positions, {DIGEST_BYTES}], got {d.dtype} "
                             f"{d.shape}", field="logits_digest")
        self.digests = d

    def __len__(self) -> int:
        return int(self.digests.shape[0])

    @classmethod
    def concat(cls, parts: list["LogitsDigests"]) -> "LogitsDigests":
        algos = {p.algo for p in parts}
        if len(algos) != 1:
            raise InputError(f"digests of different algorithms {sorted(algos)}",
                             field="logits_digest")
        return cls(np.concatenate([p.digests for p in parts]), algos.pop())


@dataclass
class DigestCheck:
    """Accumulates :meth:`add` per sequence; :meth:`summary` gives the figures. The trainer's
    row of the first mismatching position is kept (one row) so the differing token id can be
    named once the engine's row is known (:meth:`name_token`)."""
    engine: LogitsDigests
    mask: np.ndarray | None = None      # bool per position: compared where True (model tokens)
    equal: list = field(default_factory=list)
    first_mismatch: dict | None = None
    trainer_row: np.ndarray | None = None    # float32 [V] of the first mismatching position

    def add(self, start: int, logits) -> None:
        """The trainer's raw logits rows ``[r, V]`` (numpy or torch; model dtype or float32) of
        flat response positions ``start .. start + r - 1``."""
        rows = _fp32_rows(logits)
        r = rows.shape[0]
        eng = self.engine.digests[start:start + r]
        if eng.shape[0] != r:
            raise InputError(f"positions {start}..{start + r - 1} beyond the engine's "
                             f"{len(self.engine)} digests", field="logits_digest", index=start)
        pos = start + np.arange(r)
        if self.mask is not None:    # multi-turn: observation tokens were never sampled
            sel = np.asarray(self.mask[start:start + r], dtype=bool)
            rows, eng, pos = rows[sel], eng[sel], pos[sel]
        same = (row_digests(rows, self.engine.algo) == eng).all(axis=1)
        self.equal.append(same)
        if self.first_mismatch is None and not same.all():
            t = int(np.argmin(same))
            self.first_mismatch = {"position": int(pos[t]), "token_id": None,
                                   "token_id_unknown": "a digest does not say which logit "
                                   "differs (the engine's row was not recomputed)"}
            self.trainer_row = rows[t].copy()

    def name_token(self, engine_row) -> None:
        """Name the first differing token id of the first mismatching position from the engine's
        row there (float32 ``[V]``; its digest must be the one recorded, else refused)."""
        if self.first_mismatch is None:
            return
        pos = self.first_mismatch["position"]
        got = np.frombuffer(row_digest(engine_row, self.engine.algo), np.uint8)
        if not (got == self.engine.digests[pos]).all():
            raise InputError(f"the engine row given for position {pos} does not have the digest "
                             "recorded there (the engine did not recompute it bit for bit)",
                             field="logits_digest", index=pos)
        tok = first_differing_id(engine_row, self.trainer_row)
        self.first_mismatch["token_id"] = tok
        self.first_mismatch.pop("token_id_unknown", None)
        if tok is not None:
            self.first_mismatch["engine_logit"] = float(_fp32_rows(engine_row)[0, tok])
            self.first_mismatch["trainer_logit"] = float(self.trainer_row[tok])

    def summary(self) -> dict:
        b = np.concatenate(self.equal) if self.equal else np.zeros(0, bool)
        return {"algo": self.engine.algo, "positions": int(b.size),
                "frac_bitwise": float(b.mean()) if b.size else 1.0,
                "first_mismatch": self.first_mismatch}
