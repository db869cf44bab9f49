"""Sharded delta transfer: each trainer rank publishes only the blocks engine ranks need from it,
each engine rank reads only its own blocks, and a version switches on every engine rank or on none.

A :class:`~skyrl_numerics.sync.shard_plan.Plan` says which trainer rank sends which block of
which HF tensor to which engine rank. This module moves those blocks with the delta sync of
``weight_sync.py`` — one delta stream per link of the plan — and loads them into a live vLLM engine
through the one load path (``sync/vllm.py::load_into_model``: vLLM's own loaders and
``process_weights_after_loading``, so fused, padded or repacked parameters come out as after a
full load).

Store layout under ``root`` (a path or fsspec URL)::

    links/s<S>-d<D>/          the delta stream of the link S -> D (DeltaPublisher / DeltaReceiver):
                              one tensor per block, named ``<hf name>@<a>:<b>,<c>:<d>`` (its box in
                              the HF tensor), XOR against the link's previous version, zstd
    versions/<v:012d>.json    the version record, written last by :meth:`ShardedPublisher.seal`
                              once every link holds version v: ``{format, version, plan_digest,
                              links: {"S-D": manifest_digest}}``, sealed like a manifest (digest,
                              HMAC-SHA256 with the shared key)

Engine rank D, version v (:class:`ShardedReceiver`):

- ``prepare(v)`` reads the record (digest, signature), refuses a record of another plan
  (``plan_digest``), and prepares the delta of every link into D: the link manifest's digest must
  be the one the record names, its tensors exactly the plan's blocks with their shapes, and every
  payload digest, decoded size and resulting tensor digest must hold. Nothing changes.
- ``commit(p)`` commits every link and returns the HF tensors to load: each HF tensor that has a
  changed block (widened to whole vLLM blocks, ``load_blocks.expand_to_blocks``), allocated at its full HF
  shape with only the rank's boxes written. vLLM's loader reads only the rank's slice; the rest of
  the allocation is never touched, so its pages are never committed to memory.

:func:`sharded_update` drives an engine: ``prepare`` on every worker; if every rank succeeded,
``commit`` on every rank, otherwise ``abort`` on every rank and an ``InputError`` naming the first
rank that refused and why. Either all ranks switch to v or none does.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from skyrl_numerics.errors import InputError
from skyrl_numerics.sync.codec import digest
from skyrl_numerics.sync.manifest import signing_key, manifest_signature, read_manifest, seal
from skyrl_numerics.sync.load_blocks import expand_to_blocks
from skyrl_numerics.sync.store import SyncStore
from skyrl_numerics.sync.weight_sync import DeltaPublisher, DeltaReceiver

RECORD_FORMAT = "skyrl-numerics.sharded-version"


def _join(root: str, rel: str) -> str:
    root = str(root)
    return os.path.join(root, rel) if "://" not in root else f"{root.rstrip('/')}/{rel}"


def link_dir(root, src: int, dst: int) -> str:
    return _join(root, f"links/s{src}-d{dst}")


def record_path(version: int) -> str:
    return f"versions/{version:012d}.json"


def block_name(hf: str, box) -> str:
    return hf + "@" + ",".join(f"{a}:{b}" for a, b in box)


def _digest_of(m) -> str:
    """A parsed manifest's ``manifest_digest`` (recomputed from its canonical JSON)."""
    return json.loads(m.to_json())["manifest_digest"]


def plan_spec(plan) -> dict:
    """The plan as plain JSON (what engine workers receive): HF shapes and ``[src, dst, hf, box]``
    per block, in the plan's order."""
    return {"hf_shapes": {k: list(v) for k, v in sorted(plan.dst.hf_shapes.items())},
            "blocks": [[t.src_rank, t.dst_rank, t.hf, [list(b) for b in t.hf_box]] for t in plan.transfers]}


def spec_digest(spec: dict) -> str:
    return digest(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode())


def _links(spec: dict) -> dict:
    """``{(src, dst): [(block name, hf, box)]}`` in the spec's order."""
    out: dict = {}
    for s, d, hf, box in spec["blocks"]:
        box = tuple((int(a), int(b)) for a, b in box)
        out.setdefault((int(s), int(d)), []).append((block_name(hf, box), hf, box))
    return out


# ---- trainer side ---------------------------------------------------------------------------------
class ShardedPublisher:
    """Trainer side. Every trainer rank calls :meth:`publish` with the tensors it holds (its physical
    shards, named as in the plan's source layout); one coordinator calls :meth:`seal` once all ranks
    have published (after a barrier). ``key``: the shared HMAC key (default
    ``$SKYRL_NUMERICS_SYNC_KEY``); ``snapshot_every``: as ``DeltaPublisher``'s."""

    def __init__(self, root, plan, *, key=None, snapshot_every: int = 10, level: int = 1):
        self.root, self.plan, self.key = str(root), plan, signing_key(key)
        self.spec = plan_spec(plan)
        self.digest = spec_digest(self.spec)
        self.links = _links(self.spec)
        self._src_box = {}
        for t in plan.transfers:
            self._src_box[(t.src_rank, t.dst_rank, block_name(t.hf, t.hf_box))] = (t.src_tensor, t.src_box)
        self._pubs = {}
        self._opts = dict(key=key, snapshot_every=snapshot_every, level=level)
        self.store = SyncStore(self.root)

    def ranks(self) -> list[int]:
        return sorted({s for s, _ in self.links})

    def publish(self, rank: int, tensors: dict, *, full: bool = False) -> dict:
        """Publish the next version of every link out of ``rank``; ``{(src, dst): Manifest}``."""
        out = {}
        for (s, d), blocks in self.links.items():
            if s != rank:
                continue
            state = {}
            for name, _, _ in blocks:
                tensor, box = self._src_box[(s, d, name)]
                if tensor not in tensors:
                    raise InputError(f"trainer rank {rank} holds no tensor {tensor!r} (the plan's "
                                     f"source layout needs it for engine rank {d})", field=tensor)
                t = tensors[tensor]
                if any(b > n for (_, b), n in zip(box, t.shape)) or len(box) != t.dim():
                    raise InputError(f"trainer rank {rank}: tensor {tensor!r} of shape {list(t.shape)} "
                                     f"does not contain the block {[list(b) for b in box]}", field=tensor)
                state[name] = t[tuple(slice(a, b) for a, b in box)].contiguous()
            pub = self._pubs.get((s, d))
            if pub is None:
                pub = self._pubs[(s, d)] = DeltaPublisher(link_dir(self.root, s, d), **self._opts)
            out[(s, d)] = pub.publish(state, full=full)
        return out

    def seal(self, version: int) -> dict:
        """Write the record of ``version`` once every link holds it (refused otherwise)."""
        links = {}
        for s, d in sorted(self.links):
            store = SyncStore(link_dir(self.root, s, d))
            try:
                m = read_manifest(store, version, key=self.key)
            except InputError as e:
                raise InputError(f"version {version}: link s{s}-d{d} is not ready ({e})",
                                 field=f"s{s}-d{d}") from None
            links[f"{s}-{d}"] = _digest_of(m)
        rec = seal({"format": RECORD_FORMAT, "version": int(version), "plan_digest": self.digest,
                    "links": links}, self.key)
        self.store.write(record_path(version), json.dumps(rec, sort_keys=True).encode())
        return rec


def read_record(store: SyncStore, version: int, *, key=None) -> dict:
    """The version record, its digest and (with a key) signature checked."""
    import hmac

    from skyrl_numerics.sync.manifest import manifest_digest

    src = record_path(version)
    raw = store.read(src, field="version")
    try:
        rec = json.loads(raw)
    except ValueError:
        raise InputError(f"{src}: not JSON", field="version", source=src) from None
    if not isinstance(rec, dict) or rec.get("format") != RECORD_FORMAT:
        raise InputError(f"{src}: not a sharded version record", field="format", source=src)
    for k, typ in (("version", int), ("plan_digest", str), ("links", dict), ("manifest_digest", str)):
        if not isinstance(rec.get(k), typ):
            raise InputError(f"{src}: field {k!r} missing or of the wrong type", field=k, source=src)
    if rec["manifest_digest"] != manifest_digest(rec):
        raise InputError(f"{src}: record digest mismatch (the record was changed)",
                         field="manifest_digest", source=src)
    k = signing_key(key)
    if k is not None and not hmac.compare_digest(str(rec.get("signature", "")), manifest_signature(rec, k)):
        raise InputError(f"{src}: signature missing or wrong", field="signature", source=src)
    if rec["version"] != version:
        raise InputError(f"{src}: holds version {rec['version']}", field="version", source=src)
    return rec


# ---- engine side ----------------------------------------------------------------------------------
@dataclass
class PreparedShards:
    version: int
    links: dict = field(default_factory=dict)       # src -> PreparedUpdate
    bytes_read: int = 0


class ShardedReceiver:
    """Engine rank ``rank``'s side of a plan (``spec``: :func:`plan_spec`). Holds the blocks it
    received (one copy of the rank's weights, the XOR base of the next delta)."""

    def __init__(self, root, spec: dict, rank: int, *, key=None, fill: float | None = None):
        self.root, self.spec, self.rank, self.key = str(root), spec, int(rank), signing_key(key)
        self.fill = fill   # None: torch.empty outside the rank's boxes; a value (NaN in tests) fills it
        self.digest = spec_digest(spec)
        self.blocks = {s: b for (s, d), b in _links(spec).items() if d == self.rank}
        if not self.blocks:
            raise InputError(f"the plan sends nothing to engine rank {rank}", field="rank")
        self.hf_shapes = {k: tuple(v) for k, v in spec["hf_shapes"].items()}
        self.receivers = {s: DeltaReceiver(link_dir(self.root, s, self.rank), key=key) for s in self.blocks}
        self.store = SyncStore(self.root)
        self.version = None

    @property
    def hf_names(self) -> list[str]:
        seen = {}
        for blocks in self.blocks.values():
            for _, hf, _ in blocks:
                seen.setdefault(hf, None)
        return list(seen)

    def prepare(self, version: int) -> PreparedShards:
        rec = read_record(self.store, version, key=self.key)
        src = record_path(version)
        if rec["plan_digest"] != self.digest:
            raise InputError(f"engine rank {self.rank}: version {version} was published for another "
                             "plan (plan_digest differs)", field="plan_digest", source=src)
        out = PreparedShards(version)
        for s, blocks in self.blocks.items():
            want = rec["links"].get(f"{s}-{self.rank}")
            if want is None:
                raise InputError(f"version {version}: the record names no link s{s}-d{self.rank}",
                                 field="links", source=src)
            p = self.receivers[s].prepare(version)
            m = p.manifest
            if _digest_of(m) != want:
                raise InputError(f"link s{s}-d{self.rank}, version {version}: manifest is not the one "
                                 "the version record names", field="manifest_digest", source=src)
            shapes = {e.name: tuple(e.shape) for e in m.tensors}
            for name, _, box in blocks:
                if shapes.get(name) != tuple(b - a for a, b in box):
                    raise InputError(f"link s{s}-d{self.rank}, version {version}: block {name!r} "
                                     f"{'is missing' if name not in shapes else f'has shape {list(shapes[name])}'}"
                                     f" (the plan's box is {[b - a for a, b in box]})", field=name, source=src)
            if len(shapes) != len(blocks):
                extra = sorted(set(shapes) - {n for n, _, _ in blocks})
                raise InputError(f"link s{s}-d{self.rank}, version {version}: block {extra[0]!r} is "
                                 "not in the plan", field=extra[0], source=src)
            out.links[s] = p
            out.bytes_read += sum(e.payload_nbytes or 0 for e in m.tensors)
        return out

    def commit(self, prepared: PreparedShards) -> list:
        """Commit every link; ``[(hf name, tensor)]`` to load (module docstring)."""
        import torch

        first = self.version is None
        changed = set()
        for s, p in prepared.links.items():
            changed.update(n.rsplit("@", 1)[0] for n in p.new_bytes)
            self.receivers[s].commit(p)
        self.version = prepared.version
        names = self.hf_names if first else expand_to_blocks(changed, self.hf_names)
        want = set(names)
        full = {}
        for s, blocks in self.blocks.items():
            held = self.receivers[s].state
            for name, hf, box in blocks:
                if hf not in want:
                    continue
                b = held[name]
                if hf not in full:
                    full[hf] = (torch.empty(self.hf_shapes[hf], dtype=b.dtype) if self.fill is None
                                else torch.full(self.hf_shapes[hf], self.fill, dtype=b.dtype))
                full[hf][tuple(slice(a, c) for a, c in box)].copy_(b)
        return [(n, full[n]) for n in names]
