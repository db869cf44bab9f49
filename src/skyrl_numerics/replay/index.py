"""PackedIndex: the DeepSeek-V3.2 (DSA) lightning indexer's choices, the key positions each query
attends to, per token and per indexer layer — the attention's routing decision, recorded by the
engine and replayed by the trainer like MoE routes (:mod:`.routes`).

What a row is. Query position ``p`` of a layer attends to ``count(p) = min(topk, p + 1)`` keys
(:mod:`skyrl_numerics.invariant.deepseek_v32`): for ``p < topk`` that is every visible key
``0 .. p`` — no choice, nothing to record — and for ``p >= topk`` the ``topk`` positions of
largest index score, strictly ascending, each ``<= p``. So a sequence of ``n`` tokens stores the
rows of positions ``topk .. n - 2`` only (the route convention: the engine never runs the final
sampled token), ``max(0, n - 1 - topk)`` rows of ``[L, topk]`` positions, and the counts are
implied by the positions.

Storage. The rows are a :class:`~.routes.PackedRoutes` whose "expert ids" are key positions and
whose ``num_experts`` is the position bound ``P = max_b (n_b - 1)`` (every position ``< P``):
``uint8`` / ``uint16`` / ``uint32`` in memory by ``P``, and ``to_bytes(bitpack=True)`` stores
``ceil(log2 P)`` bits per position (:mod:`.bitpack`). Per token beyond the first ``topk``::

    bytes/token = L · topk · ceil(log2 P) / 8

DeepSeek-V3.2 (61 indexer layers, ``index_topk`` 2048): 15 616 B per bit of width — at P = 8 Ki
(13 bits) 203 008 B (198 KiB), at 32 Ki (15 bits) 234 240 B, at 128 Ki (17 bits) 265 472 B
(259 KiB) per token; the MoE routes of the same token (58 MoE layers · top-8 ids · 8 bits) are
464 B. :func:`bytes_per_token` computes it. A bitmap of the ``p + 1`` visible keys per row
(``L · (p + 1) / 8`` bytes) would be smaller below ``p = topk · bits`` (34 816 at 17 bits); only
the position lists are implemented.

Multi-turn: the engine sends each turn's rows from the trace's end on (the routes' ``starts``),
assembled by a :class:`~.trace.RouteTrace` over all positions; :meth:`PackedIndex.from_sequences`
drops the implied rows at the end.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from skyrl_numerics.errors import InputError

from .routes import int_scalar, PackedRoutes


def bytes_per_token(layers: int, topk: int, bound: int) -> float:
    """Bit-packed bytes of one recorded token: ``layers · topk · ceil(log2 bound) / 8``."""
    return layers * topk * max(1, math.ceil(math.log2(max(2, bound)))) / 8


class PackedIndex:
    """Indexer choices: ``rows`` (key positions ``[Σ_b max(0, n_b - 1 - topk), L, topk]``,
    sequence ``b``'s rows for positions ``topk ..``) and ``topk``. Validated: every stored row is
    strictly ascending and causal (its entries ``<= p``)."""

    __slots__ = ("rows", "topk")

    def __init__(self, rows: PackedRoutes, topk: int, *, validate: bool = True):
        self.rows = rows
        self.topk = int_scalar(topk, "topk", 1, (1 << 31) - 1)
        if rows.k != self.topk:
            raise InputError(f"rows hold {rows.k} positions per query, topk is {self.topk}",
                             field="topk")
        if validate:
            self.validate()

    @classmethod
    def from_sequences(cls, seqs: Sequence[np.ndarray], topk: int) -> "PackedIndex":
        """From each sequence's rows of every position ``0 .. n_b - 2`` (``[n_b - 1, L, topk]``,
        what the engine and the trainer record): the rows of positions ``< topk`` are dropped
        (implied) after checking they hold exactly the visible keys."""
        topk = int_scalar(topk, "topk", 1, (1 << 31) - 1)
        seqs = [np.asarray(s) for s in seqs]
        for b, s in enumerate(seqs):
            if s.ndim != 3 or s.shape[2] != topk:
                raise InputError(f"expected [positions, layers, {topk}], got {s.shape}",
                                 field="seqs", index=b)
            head = s[:topk]
            want = implied_rows(head.shape[0], topk)
            bad = (head != want[:, None, :]).any(axis=(1, 2))
            if bad.any():
                p = int(np.argmax(bad))
                raise InputError(f"sequence {b}: position {p} (< topk {topk}) does not attend to "
                                 f"exactly its {p + 1} visible keys", field="seqs", index=b)
        bound = max([1] + [s.shape[0] for s in seqs])
        rows = PackedRoutes.from_sequences([s[topk:] for s in seqs], bound)
        return cls(rows, topk)

    # ---- views -------------------------------------------------------------------------------
    @property
    def num_seqs(self) -> int:
        return self.rows.num_seqs

    @property
    def num_layers(self) -> int:
        return self.rows.num_layers

    def seq(self, b: int) -> np.ndarray:
        """Sequence ``b``'s stored rows ``[m, L, topk]`` (positions ``topk .. topk + m - 1``)."""
        return self.rows.seq(b)

    def full_rows(self, b: int, n: int) -> np.ndarray:
        """Sequence ``b``'s rows of positions ``0 .. n - 1`` as the indexer returns them (``[n, L,
        topk]`` int64; entries past a row's count 0), the stored rows where ``n`` reaches them;
        positions past the stored rows raise (the caller computes those itself)."""
        stored = self.seq(b)
        if n > self.topk + stored.shape[0]:
            raise InputError(f"sequence {b}: {n} positions asked for, rows cover "
                             f"{self.topk + stored.shape[0]}", field="index", row=b)
        head = np.broadcast_to(implied_rows(min(n, self.topk), self.topk)[:, None, :],
                               (min(n, self.topk), self.num_layers, self.topk))
        return np.concatenate([head, stored[:max(0, n - self.topk)]]).astype(np.int64)

    def validate(self) -> "PackedIndex":
        for b in range(self.num_seqs):
            s = self.seq(b).astype(np.int64)
            if not s.size:
                continue
            pos = self.topk + np.arange(s.shape[0])
            bad = (s.max(axis=2) > pos[:, None]).any(axis=1) | (np.diff(s, axis=2) <= 0).any(axis=(1, 2))
            if bad.any():
                p = int(pos[np.argmax(bad)])
                raise InputError(f"sequence {b}, position {p}: key positions not strictly "
                                 "ascending or past the query (not causal)", field="index", row=b)
        return self

    def nbytes(self, *, bitpack: bool = True) -> int:
        """Serialized size (:meth:`to_bytes`)."""
        return int(self.rows.to_buffer(bitpack=bitpack).nbytes)

    def to_bytes(self, *, bitpack: bool = True) -> bytes:
        """The rows' buffer (:meth:`PackedRoutes.to_bytes`: header, digest, ``ceil(log2 P)`` bits
        a position when bit-packed); ``topk`` is its ``k``."""
        return self.rows.to_bytes(bitpack=bitpack)

    @classmethod
    def from_bytes(cls, data) -> "PackedIndex":
        rows = PackedRoutes.from_bytes(data)
        return cls(rows, rows.k)

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The rows' arrays (:meth:`PackedRoutes.to_arrays`); ``topk`` is their ``k``."""
        return self.rows.to_arrays()

    @classmethod
    def from_arrays(cls, d: dict[str, np.ndarray]) -> "PackedIndex":
        rows = PackedRoutes.from_arrays(d)
        return cls(rows, rows.k)

    @classmethod
    def concat(cls, parts: Sequence["PackedIndex"]) -> "PackedIndex":
        """Sequences of several parts (same L, topk) in order, at the largest position bound."""
        if not parts:
            raise InputError("nothing to concatenate", field="parts")
        bound = max(p.rows.num_experts for p in parts)
        seqs = [p.seq(b) for p in parts for b in range(p.num_seqs)]
        return cls(PackedRoutes.from_sequences(seqs, bound), parts[0].topk)

    def check_rollout(self, seq_lens: np.ndarray) -> None:
        """Sequence ``b`` of ``seq_lens[b]`` tokens has ``max(0, n - 1 - topk)`` stored rows."""
        have = np.asarray(self.rows.seq_lens, np.int64)
        if have.shape[0] != len(seq_lens):
            raise InputError(f"index choices for {have.shape[0]} sequences, {len(seq_lens)} in "
                             "the rollout", field="index")
        want = np.maximum(0, np.asarray(seq_lens, np.int64) - 1 - self.topk)
        if (have != want).any():
            b = int(np.flatnonzero(have != want)[0])
            raise InputError(f"index choices: {int(have[b])} rows, prompt+response needs "
                             f"{int(want[b])} (positions {self.topk} .. n - 2)", field="index", row=b)

    def __eq__(self, other) -> bool:
        return isinstance(other, PackedIndex) and self.topk == other.topk and self.rows == other.rows

    def __repr__(self) -> str:
        return (f"PackedIndex(seqs={self.num_seqs}, rows={self.rows.num_tokens}, "
                f"layers={self.num_layers}, topk={self.topk}, bound={self.rows.num_experts})")


def implied_rows(n: int, topk: int) -> np.ndarray:
    """The rows of positions ``0 .. n - 1 < topk``: ``[0, 1, .., p, 0, .., 0]`` (``[n, topk]``)."""
    ar = np.arange(topk)
    return np.where(ar[None, :] <= np.arange(n)[:, None], ar[None, :], 0)
