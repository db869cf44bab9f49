"""Sharded weight transfer: which trainer rank sends which block of which tensor to which engine rank.

Both sides hold the same logical weights — the tensors of the Hugging Face checkpoint — cut and fused
differently. A :class:`Layout` says, for one side, where every block lives::

    Piece(rank, tensor, hf, box, at):   rank's physical ``tensor``[at : at + size(box)] == HF ``hf``[box]

(``box``: a ``(start, stop)`` per dimension of the HF tensor; the block keeps its shape, no transpose;
an ``at`` longer than ``box`` puts the block at fixed indices of the leading dimensions, e.g. expert
``i`` of a stack ``[E, 2f, H]`` holds a 2-D HF expert tensor).
:func:`megatron_layout` describes megatron-core's GPTModel as ``trainer/megatron/mapping.py`` builds it
(fused ``linear_qkv`` interleaved per KV group, ``linear_fc1 = [gate; up]`` per expert, vocabulary
rows split in ``torch.chunk`` blocks, experts whole per EP rank with expert-TP 1, layers over PP
stages; ranks from megatron-core's own ``RankGenerator``). :func:`vllm_layout` describes vLLM's
Qwen3-MoE at tensor parallel ``tp`` (``qkv_proj = [q heads; k heads; v heads]`` of the rank, KV heads
replicated when ``tp > num_key_value_heads``, ``gate_up_proj``/``w13 = [gate; up]`` cut along the
FFN width, or experts whole per rank with expert parallelism, vocabulary in blocks of the padded
vocabulary as ``VocabParallelEmbedding`` pads it).

:func:`plan` intersects the two: for every destination piece and every distinct source block that
overlaps it, one :class:`Transfer` from one source replica — the destination's own rank when it holds
the block (colocated: a local copy), else the replica that has sent the fewest bytes so far. The
result, per destination rank, covers each of its pieces exactly once (checked: :meth:`Plan.check`),
and a source rank sends only blocks it holds. A full gather, for comparison, moves every tensor a
destination rank touches whole (``Plan.full_bytes``). :func:`materialize` builds a layout's rank
tensors from full HF tensors and :func:`execute` runs a plan on real tensors (the receiver's apply;
tests compare the result bitwise with the destination's own layout).
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from skyrl_numerics.errors import InputError

Box = tuple  # ((start, stop), ...) per dimension


@dataclass(frozen=True)
class Piece:
    rank: int
    tensor: str
    hf: str
    box: Box
    at: tuple

    @property
    def numel(self) -> int:
        return math.prod(b - a for a, b in self.box)


@dataclass
class Layout:
    """Where each HF tensor's blocks live on one side (``world`` ranks)."""
    name: str
    world: int
    hf_shapes: dict
    pieces: list = field(default_factory=list)
    shapes: dict = field(default_factory=dict)     # (rank, tensor) -> physical shape

    def add(self, rank: int, tensor: str, hf: str, box, at=None, shape=None):
        box = tuple((int(a), int(b)) for a, b in box)
        if any(b <= a for a, b in box):
            return
        at = tuple(int(a) for a in at) if at is not None else (0,) * len(box)
        self.pieces.append(Piece(rank, tensor, hf, box, at))
        if shape is not None:
            self.shapes[(rank, tensor)] = tuple(shape)

    def rank_bytes(self, itemsize: int = 2) -> dict:
        out = defaultdict(int)
        for p in self.pieces:
            out[p.rank] += p.numel * itemsize
        return dict(out)


@dataclass(frozen=True)
class Transfer:
    src_rank: int
    src_tensor: str
    src_box: Box        # in the source's physical tensor
    dst_rank: int
    dst_tensor: str
    dst_box: Box        # in the destination's physical tensor
    numel: int
    hf: str = ""        # the HF tensor the block belongs to
    hf_box: Box = ()    # the block in HF coordinates


@dataclass
class Plan:
    transfers: list
    itemsize: int
    dst: Layout
    src: Layout
    colocate_offset: int = 0    # destination rank d shares a device with source rank d + offset

    def _local(self, t) -> bool:
        return t.src_rank == t.dst_rank + self.colocate_offset

    def sent(self) -> dict:
        out = defaultdict(int)
        for t in self.transfers:
            if not self._local(t) or self.src is self.dst:
                out[t.src_rank] += t.numel * self.itemsize
        return dict(out)

    def received(self, *, local: bool = False) -> dict:
        """Bytes each destination rank receives (``local``: counting copies from its own rank)."""
        out = defaultdict(int)
        for t in self.transfers:
            if local or not self._local(t):
                out[t.dst_rank] += t.numel * self.itemsize
        return dict(out)

    def links(self) -> dict:
        """Bytes per (source rank, destination rank) pair, local copies left out."""
        out = defaultdict(int)
        for t in self.transfers:
            if not self._local(t):
                out[(t.src_rank, t.dst_rank)] += t.numel * self.itemsize
        return dict(out)

    def full_bytes(self) -> dict:
        """Bytes each destination rank would read with a full gather: every HF tensor it touches, whole."""
        touched = defaultdict(set)
        for p in self.dst.pieces:
            touched[p.rank].add(p.hf)
        return {r: sum(math.prod(self.dst.hf_shapes[h]) for h in hs) * self.itemsize
                for r, hs in touched.items()}

    def model_bytes(self) -> int:
        """Bytes of the whole model: what each engine rank reads when every rank gets everything."""
        return sum(math.prod(s) for s in self.dst.hf_shapes.values()) * self.itemsize

    def check(self) -> None:
        """Every destination piece covered exactly once, every block sent by a rank that holds it."""
        held = defaultdict(list)
        for p in self.src.pieces:
            held[(p.rank, p.tensor)].append(p)
        got = defaultdict(int)
        for t in self.transfers:
            if not any(_inside(t.src_box, _phys(p)) for p in held[(t.src_rank, t.src_tensor)]):
                raise InputError(f"rank {t.src_rank} does not hold {t.src_tensor}{list(t.src_box)}",
                                 field="plan")
            got[(t.dst_rank, t.dst_tensor)] += t.numel
        want = defaultdict(int)
        for p in self.dst.pieces:
            want[(p.rank, p.tensor)] += p.numel
        for key, n in want.items():
            if got.get(key, 0) != n:
                raise InputError(f"destination rank {key[0]} tensor {key[1]!r}: plan covers "
                                 f"{got.get(key, 0)} of {n} elements", field="plan")
        seen = defaultdict(list)       # overlap check between transfers into one tensor
        for t in self.transfers:
            for other in seen[(t.dst_rank, t.dst_tensor)]:
                if _intersect(other, t.dst_box) is not None:
                    raise InputError(f"destination rank {t.dst_rank} tensor {t.dst_tensor!r}: "
                                     f"{list(t.dst_box)} written twice", field="plan")
            seen[(t.dst_rank, t.dst_tensor)].append(t.dst_box)


def _phys(p: Piece, box: Box | None = None) -> Box:
    """``box`` (default: the whole piece; HF coordinates inside ``p.box``) in ``p``'s physical tensor."""
    box = p.box if box is None else box
    lead = len(p.at) - len(p.box)
    return tuple((o, o + 1) for o in p.at[:lead]) + tuple(
        (o + x - a, o + y - a) for o, (a, _), (x, y) in zip(p.at[lead:], p.box, box))


def _intersect(a: Box, b: Box):
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(hi <= lo for lo, hi in out) else out


def _inside(a: Box, b: Box) -> bool:
    return all(y0 <= x0 and x1 <= y1 for (x0, x1), (y0, y1) in zip(a, b))


def plan(src: Layout, dst: Layout, *, itemsize: int = 2, colocate_offset: int = 0,
         load: dict | None = None) -> Plan:
    """The transfers that give every destination piece its bytes (module docstring).

    ``colocate_offset``: destination rank ``d`` shares a device with source rank
    ``d + colocate_offset`` (a colocated engine replica placed from that device on), so a block that
    rank holds is a local copy. ``load``: bytes already assigned per source rank (shared across the
    plans of several engine replicas so the least-loaded choice spreads over all of them)."""
    if set(src.hf_shapes) != set(dst.hf_shapes) or any(
            tuple(src.hf_shapes[k]) != tuple(dst.hf_shapes[k]) for k in src.hf_shapes):
        bad = sorted(set(src.hf_shapes) ^ set(dst.hf_shapes)) or sorted(
            k for k in src.hf_shapes if tuple(src.hf_shapes[k]) != tuple(dst.hf_shapes[k]))
        raise InputError(f"layouts {src.name!r} and {dst.name!r} disagree on {bad[:3]}", field="layout")
    by_hf = defaultdict(lambda: defaultdict(list))      # hf -> src box -> replicas
    for p in src.pieces:
        by_hf[p.hf][p.box].append(p)
    load = defaultdict(int) if load is None else load
    out = []
    for d in dst.pieces:
        covered = 0
        here = d.rank + colocate_offset
        for box, reps in by_hf[d.hf].items():
            inter = _intersect(box, d.box)
            if inter is None:
                continue
            s = next((r for r in reps if r.rank == here), None) or min(
                reps, key=lambda r: (load.get(r.rank, 0), r.rank))
            n = math.prod(b - a for a, b in inter)
            covered += n
            if s.rank != here:
                load[s.rank] = load.get(s.rank, 0) + n
            out.append(Transfer(s.rank, s.tensor, _phys(s, inter), d.rank, d.tensor, _phys(d, inter), n,
                                d.hf, inter))
        if covered != d.numel:
            raise InputError(f"{src.name}: HF {d.hf}{list(d.box)} needed by {dst.name} rank {d.rank} "
                             f"is {'not wholly held' if covered < d.numel else 'held twice'} "
                             f"({covered} of {d.numel} elements)", field=d.hf)
    return Plan(out, itemsize, dst, src, colocate_offset)


# ---- real tensors -----------------------------------------------------------------------------
def materialize(layout: Layout, hf: dict) -> dict:
    """``{rank: {tensor: torch.Tensor}}`` of ``layout`` filled from the full HF tensors ``hf``."""
    import torch

    out = defaultdict(dict)
    for p in layout.pieces:
        t = hf[p.hf]
        key = (p.rank, p.tensor)
        if p.tensor not in out[p.rank]:
            out[p.rank][p.tensor] = torch.zeros(layout.shapes[key], dtype=t.dtype)
        view = out[p.rank][p.tensor][tuple(slice(a, b) for a, b in _phys(p))]
        view.copy_(t[tuple(slice(a, b) for a, b in p.box)].reshape(view.shape))
    return {r: dict(v) for r, v in out.items()}


def execute(p: Plan, src: dict, dst: dict) -> None:
    """Copy every transfer's block from ``src[rank][tensor]`` into ``dst[rank][tensor]`` in place."""
    for t in p.transfers:
        view = dst[t.dst_rank][t.dst_tensor][tuple(slice(a, b) for a, b in t.dst_box)]
        view.copy_(src[t.src_rank][t.src_tensor][tuple(slice(a, b) for a, b in t.src_box)]
                   .reshape(view.shape))
