"""The DSA indexer's choices in the trainer's forward: replay the engine's
(:class:`IndexReplay`, R3 for the attention) and record the trainer's own (:class:`IndexRecorder`).

The batch-invariant DeepSeek-V3.2 (:mod:`skyrl_numerics.invariant.deepseek_v32`) asks its
``index_source(layer, qi, wt, ki, pos, select)`` for each call's ``(sel [n, Sq, K], count [n,
Sq])`` when one is set, instead of running its own selection ``select(qi, wt, ki, pos)``. The
trainer's packed forward calls the attention once per sequence and layer, sequences in rollout
order, so call ``c`` of layer ``l`` is sequence ``order[c]``. Replayed rows: the positions the
:class:`~.index.PackedIndex` covers (``p < topk``: every visible key; then the stored rows);
positions past them (the final sampled token, which predicts nothing) use the trainer's own
selection. ``count = min(K, p + 1)`` as the indexer's (implied by the positions). With
``compare=True`` the trainer's own selection is computed too and every covered row it chooses
differently from the engine is counted (``mismatch``, per layer) — the indexer's disagreement;
``replay=False`` with it keeps the trainer's own choices (compare only).
"""
from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from typing import Sequence

import numpy as np
import torch

from skyrl_numerics.errors import InputError

from .index import PackedIndex


class IndexReplay:
    """``model.index_source`` replaying ``index`` for the sequences ``order`` (rollout rows, in
    the forward's order)."""

    def __init__(self, index: PackedIndex, order: Sequence[int], *, compare: bool = False,
                 replay: bool = True):
        self.index, self.order = index, [int(b) for b in order]
        self.compare, self.replay = compare or not replay, replay
        self.calls: dict[int, int] = defaultdict(int)
        self.mismatch: dict[int, int] = defaultdict(int)    # layer -> rows chosen differently
        self.compared = 0                                    # rows compared, all layers

    def __call__(self, layer: int, qi, wt, ki, pos, select):
        n, Sq = pos.shape
        if n != 1:
            raise RuntimeError(f"index replay: {n} sequences in one attention call (the trainer's "
                               "packed forward calls it per sequence)")
        c = self.calls[layer]
        if c >= len(self.order):
            raise InputError(f"index replay: layer {layer} ran {c + 1} sequences, the replay holds "
                             f"{len(self.order)}", field="index")
        self.calls[layer] = c + 1
        b, L, topk = self.order[c], ki.shape[1], self.index.topk
        K, p0 = min(topk, L), int(pos[0, 0])
        cover = topk + self.index.seq(b).shape[0]
        m = max(0, min(Sq, cover - p0))                   # replayed queries p0 .. p0 + m - 1
        rec = self.index.full_rows(b, p0 + m)[p0:, layer, :K]
        if rec.size and int(rec.max()) >= L:
            raise InputError(f"index replay: sequence {b} layer {layer} chooses key {int(rec.max())}"
                             f" of {L}", field="index", row=b)
        sel = torch.from_numpy(np.ascontiguousarray(rec)).to(pos.device)[None]
        own = None
        if self.compare or m < Sq:
            own, _ = select(qi, wt, ki, pos)
        if m < Sq:
            sel = torch.cat([sel, own[:, m:]], dim=1)
        if self.compare and m:
            self.mismatch[layer] += int((own[0, :m] != sel[0, :m]).any(-1).sum())
            self.compared += m
        return (sel if self.replay else own), (pos + 1).clamp(max=K)

    @property
    def mismatched(self) -> int:
        return int(sum(self.mismatch.values()))


class IndexRecorder:
    """``model.index_hook`` keeping each sequence's choices: call ``c`` of layer ``l`` is
    sequence ``order[c]``'s ``[Sq, K]`` rows (``K <= topk``, padded to ``topk`` with 0)."""

    def __init__(self, order: Sequence[int], layers: int, topk: int):
        self.order, self.layers, self.topk = [int(b) for b in order], layers, topk
        self.calls: dict[int, int] = defaultdict(int)
        self.rows: dict[int, dict[int, np.ndarray]] = defaultdict(dict)   # seq -> layer -> rows

    def __call__(self, layer: int, sel, count) -> None:
        c = self.calls[layer]
        self.calls[layer] = c + 1
        out = np.zeros((sel.shape[0], self.topk), np.int64)
        out[:, :sel.shape[1]] = sel.cpu().numpy()
        self.rows[self.order[c]][layer] = out

    def packed(self, lengths: Sequence[int]) -> PackedIndex:
        """The recorded choices of positions ``0 .. n_b - 2`` per sequence (``lengths``: each
        sequence's token count ``n_b``), in ``order``."""
        seqs = [np.stack([self.rows[b][l][:n - 1] for l in range(self.layers)], axis=1)
                for b, n in zip(self.order, lengths)]
        return PackedIndex.from_sequences(seqs, self.topk)


@contextmanager
def index_modes(model, rollout, *, replay: bool = False, compare: bool = False,
                record: bool = False):
    """Set ``model``'s indexer for one pass over ``rollout`` (rows in order): ``replay`` the
    engine's choices (``rollout.index``), ``compare`` them with the trainer's own, ``record`` the
    choices the forward used. Yields ``(IndexReplay | None, IndexRecorder | None)``; restores the
    model's hooks on exit."""
    if not (replay or compare or record):
        yield None, None
        return
    if getattr(model, "index", None) is None or not hasattr(model, "index_source"):
        raise InputError(f"{type(model).__name__} has no DSA indexer to replay or record",
                         field="index")
    if (replay or compare) and getattr(rollout, "index", None) is None:
        raise InputError("the rollout has no indexer choices (generate with capture_index=True "
                         "on a batch-invariant DeepSeek-V3.2 engine)", field="index")
    order = range(len(rollout))
    rp = (IndexReplay(rollout.index, order, compare=compare, replay=replay)
          if (replay or compare) else None)
    rec = IndexRecorder(order, model.dims.layers, model.index.topk) if record else None
    prev = model.index_source, model.index_hook
    model.index_source, model.index_hook = rp, rec
    try:
        yield rp, rec
    finally:
        model.index_source, model.index_hook = prev
