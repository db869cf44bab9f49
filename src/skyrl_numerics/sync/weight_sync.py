"""Delta weight sync: XOR deltas of raw tensor bytes, zstd, a manifest, over disk or fsspec.

Publisher (trainer side), version ``v`` of a state dict ``{name: tensor}``::

    full snapshot (v == 0, every ``snapshot_every`` versions, or on request):
        payload(name) = zstd(shuffle(bytes_v(name)))                   base_version = None
    delta:
        payload(name) = zstd(shuffle(bytes_v(name) XOR bytes_{v-1}(name)))   base_version = v - 1
        (no payload at all when the XOR is all zero: the tensor did not change)

Payloads are written first, the manifest ``manifests/<v:012d>.json`` last, each atomically
(temp name + rename), so a manifest never names a payload that is not there yet.

Receiver (engine side) holds its current weights (its own tensors, or a live ``torch.nn.Module``'s
parameters and buffers) and applies manifests in version order. ``prepare(v)`` reads and verifies
everything — manifest schema, order and base, names, dtypes, shapes, payload digests, decoded
sizes, and the digest of every resulting tensor — without touching the weights; ``commit``
then copies the new bytes in. A bad manifest raises ``InputError`` naming the tensor and field and
leaves the last good weights in place. ``prepare`` can run in a thread while the engine generates
(SkyRL overlaps the fetch with generation); ``commit`` is a memcpy per changed tensor.

Manifest schema, parsing and signing: ``manifest.py`` (and ``docs/weight_sync.md``). Every
manifest carries ``manifest_digest``, the digest of its canonical JSON (every other field: names, dtypes, shapes, sizes, versions, payload
paths and digests), checked before anything else is read. With a shared key
(``DeltaPublisher(..., key=...)`` / ``DeltaReceiver(..., key=...)`` or the environment variable
``SKYRL_NUMERICS_SYNC_KEY``) the publisher adds ``signature`` = HMAC-SHA256 of the same bytes, and a
receiver with a key refuses unsigned or wrongly signed manifests.

Serving formats (``DeltaPublisher(root, weights_format="deepseek_fp8")``, see
``skyrl_numerics.sync.serving``): the publisher quantizes the selected bf16 weights at
publish time (``quant.quantize`` with the format's recipe) and publishes the codes and scales; the
manifest names the format in ``weights_format`` (covered by the digest and the signature), and a
receiver refuses a version in another format than the one it was built for (default ``native``).
"""
from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from skyrl_numerics.errors import InputError
from skyrl_numerics.sync.codec import (DIGEST, Scratch, Zstd, digest, dtype_from_name, dtype_name,
                                       shuffle, tensor_bytes, tensor_from_bytes, unshuffle,
                                       xor_bytes)
from skyrl_numerics.sync.serving import (NATIVE, check_format, check_serving_tensors, make_selector,
                                         serving_state)
from skyrl_numerics.sync.entry_fields import dtype_itemsize
from skyrl_numerics.sync.manifest import (CHECKSUM_ALGOS, Manifest, TensorEntry, list_versions,
                                          manifest_path, payload_dir, read_manifest,
                                          readable_versions, signing_key, verify_payload)
from skyrl_numerics.sync.store import SyncStore


class _IOWindow:
    """At most ``workers`` file reads/writes in flight, results in submission order.

    Object stores answer each request after a round trip (tens of ms); overlapping the requests
    of one version hides that latency, and the window bounds the bytes held in memory."""

    def __init__(self, workers: int):
        from concurrent.futures import ThreadPoolExecutor

        self.workers = max(int(workers), 1)
        self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="weight-sync-io")
        self.pending: deque = deque()

    def submit(self, fn, *args, **kw) -> None:
        self.pending.append(self.pool.submit(fn, *args, **kw))

    def full(self) -> bool:
        return len(self.pending) >= self.workers

    def next(self):
        return self.pending.popleft().result()

    def drain(self) -> None:
        while self.pending:
            self.next()

    def close(self) -> None:
        for f in self.pending:
            f.cancel()
        self.pool.shutdown(wait=True)


# ---- publisher ------------------------------------------------------------------------------
class DeltaPublisher:
    """Publishes successive versions of a state dict to ``root`` (path or fsspec URL).

    Keeps one copy of the last published bytes per tensor (host memory = one copy of the
    weights): the XOR base. ``snapshot_every``: a full snapshot when ``version % N == 0``.
    ``checksum``: ``"xxh3-128"`` (default when ``xxhash`` is installed) or ``"blake2b-128"``.
    ``start_version``: default, one after the newest version already in ``root``.
    ``io_workers``: payload writes in flight at once (object stores: hides per-request latency).
    ``key``: shared HMAC-SHA256 key (bytes/str; default ``$SKYRL_NUMERICS_SYNC_KEY``): manifests
    are signed with it.
    ``weights_format``: ``"native"`` (publish the tensors as given) or a serving format of
    :data:`serving.SERVING_FORMATS` (``"deepseek_fp8"``, ``"ct_fp8_block"``, ``"ct_int4"``,
    ``"ct_nvfp4"``, ...): the weights chosen by ``quantize`` (default: linear projections and
    expert stacks; a predicate on the name or fnmatch patterns) are quantized at publish time and
    their codes and scales published instead.
    """

    def __init__(self, root: str | os.PathLike, *, snapshot_every: int = 10, level: int = 1,
                 use_shuffle: bool = True, start_version: int | None = None,
                 checksum: str | None = None, io_workers: int = 8, key=None,
                 weights_format: str = NATIVE, quantize=None):
        self.key = signing_key(key)
        self.weights_format = check_format(weights_format)
        self._select = make_selector(quantize)
        self.last_quantized: list[str] = []   # names the last publish quantized
        if snapshot_every < 1:
            raise InputError(f"snapshot_every must be >= 1, got {snapshot_every}",
                             field="snapshot_every")
        self.store = SyncStore(root)
        if checksum is not None and checksum not in CHECKSUM_ALGOS:
            raise InputError(f"checksum {checksum!r} is not one of {CHECKSUM_ALGOS}",
                             field="checksum")
        self.checksum = checksum or DIGEST
        self.io_workers = io_workers
        self.snapshot_every = snapshot_every
        self.use_shuffle = use_shuffle
        self.zstd = Zstd(level)
        if start_version is None:  # resume after what the store already holds
            vs = list_versions(self.store)
            start_version = vs[-1] + 1 if vs else 0
        self.next_version = start_version
        self._prev: dict[str, tuple[str, tuple[int, ...], np.ndarray]] | None = None
        self._scratch = Scratch()

    def publish(self, state: Mapping[str, Any], *, full: bool = False) -> Manifest:
        """Publish ``state`` as the next version; returns its manifest."""
        import torch

        if not state:
            raise InputError("empty state dict", field="state")
        if self.weights_format != NATIVE:
            for name in state:
                if not isinstance(name, str):
                    raise InputError(f"tensor name {name!r} is not a string", field="state")
            state, quantized = serving_state(state, self.weights_format, self._select)
        else:
            quantized = []
        cur: dict[str, tuple[str, tuple[int, ...], np.ndarray]] = {}
        for name, t in state.items():
            if not isinstance(name, str):
                raise InputError(f"tensor name {name!r} is not a string", field="state")
            if not isinstance(t, torch.Tensor):
                raise InputError(f"expected a torch.Tensor, got {type(t).__name__}", field=name)
            t = t.detach().to("cpu").contiguous()
            cur[name] = (dtype_name(t.dtype), tuple(t.shape), tensor_bytes(t))  # live view
        v = self.next_version
        full = full or self._prev is None or v % self.snapshot_every == 0
        if not full:
            self._check_same_structure(cur)
        filters = (() if full else ("xor",)) + (("shuffle",) if self.use_shuffle else ())
        entries = []
        io = _IOWindow(self.io_workers)
        try:
            self._encode_all(cur, full, v, entries, io)
            io.drain()
        finally:
            io.close()
        manifest = Manifest(version=v, base_version=None if full else v - 1,
                            tensors=tuple(entries), level=self.zstd.level, filters=filters,
                            created_unix=time.time(), weights_format=self.weights_format)
        self.store.write(manifest_path(v), manifest.to_json(self.key))  # last: payloads are in place
        # Only now does this version become the XOR base: a publish that failed above leaves the
        # previous base (and the previous manifest) as they were.
        if self._same_structure(cur):
            for name, (_, _, b) in cur.items():
                np.copyto(self._prev[name][2], b)
        else:
            self._prev = {n: (dt, sh, b.copy()) for n, (dt, sh, b) in cur.items()}
        self.next_version = v + 1
        self.last_quantized = quantized
        return manifest

    def _encode_all(self, cur, full: bool, v: int, entries: list, io: "_IOWindow") -> None:
        """Encode every tensor of version ``v``; payload writes go through ``io``."""
        for i, (name, (dt, shape, b)) in enumerate(cur.items()):
            itemsize = dtype_itemsize(dtype_from_name(dt))
            data = b
            if not full:
                data = xor_bytes(b, self._prev[name][2], out=self._scratch.get("xor", b.size))
                if not data.any():
                    entries.append(TensorEntry(name, dt, shape, b.size, digest(b, self.checksum),
                                               None, 0, None))
                    continue
            if self.use_shuffle:
                data = shuffle(data, itemsize, out=self._scratch.get("shuffle", b.size))
            blob = self.zstd.compress(data)
            rel = f"{payload_dir(v)}/{i:06d}.zst"
            if io.full():
                io.next()  # a failed write raises here: no manifest for this version
            io.submit(self.store.write, rel, blob)
            entries.append(TensorEntry(name, dt, shape, b.size, digest(b, self.checksum), rel,
                                       len(blob), digest(blob, self.checksum)))

    def _same_structure(self, cur) -> bool:
        prev = self._prev
        return prev is not None and prev.keys() == cur.keys() and all(
            prev[n][:2] == cur[n][:2] for n in cur)

    def prune(self, keep_last: int = 2) -> list[int]:
        """Delete old versions, keeping the newest ``keep_last`` and the full snapshot they start
        from, so every receiver can still catch up. Manifests go before their payloads."""
        vs = list_versions(self.store)
        if not vs:
            return []
        cutoff = vs[-1] - max(keep_last, 1) + 1
        fulls = [v for v in vs if v <= cutoff and read_manifest(self.store, v, key=self.key).is_full]
        if not fulls:
            return []
        gone = [v for v in vs if v < fulls[-1]]
        for v in gone:
            self.store.remove_tree(manifest_path(v))
            self.store.remove_tree(payload_dir(v))
        return gone

    def _check_same_structure(self, cur) -> None:
        prev = self._prev
        for name, (dt, shape, _) in cur.items():
            if name not in prev:
                raise InputError(f"tensor {name!r} is new since the last version; publish a "
                                 "full snapshot (full=True)", field=name)
            if (dt, shape) != prev[name][:2]:
                raise InputError(f"tensor {name!r} changed from {prev[name][0]}"
                                 f"{list(prev[name][1])} to {dt}{list(shape)}; publish a full "
                                 "snapshot (full=True)", field=name)
        gone = [n for n in prev if n not in cur]
        if gone:
            raise InputError(f"tensor {gone[0]!r} is missing from the state ({len(gone)} "
                             "missing); publish a full snapshot (full=True)", field=gone[0])


# ---- receiver -------------------------------------------------------------------------------
@dataclass
class PreparedUpdate:
    """A verified version, ready to commit: new bytes for each changed tensor."""

    manifest: Manifest
    new_bytes: dict[str, np.ndarray] = field(default_factory=dict)
    fetch_s: float = 0.0
    token: int = 0  # which prepare() filled the receiver's staging buffers


class DeltaReceiver:
    """Applies published versions from ``root`` to the weights it holds.

    ``target``: ``None`` (the receiver owns its tensors; the first version applied must be a
    full snapshot), a dict of tensors, or a ``torch.nn.Module`` (its ``state_dict`` tensors are
    updated in place, byte for byte). ``version``: the version ``target`` already holds, if any.
    ``io_workers``: payload reads in flight at once.
    ``key``: shared HMAC-SHA256 key (default ``$SKYRL_NUMERICS_SYNC_KEY``): when set, unsigned or
    wrongly signed manifests are refused. ``expect``: for a receiver without ``target``, a module or
    state dict whose names, dtypes and shapes the first snapshot must match (it is not written).
    ``max_bytes``: refuse a version whose tensors total more raw bytes than this.
    ``weights_format``: the format this receiver holds (``"native"``, or a serving format such as
    ``"deepseek_fp8"``): a version published in another format is refused (field
    ``weights_format``), and serving-format versions get their codes/scales structure checked
    before commit.
    """

    def __init__(self, root: str | os.PathLike, target=None, *, version: int | None = None,
                 io_workers: int = 8, key=None, expect=None, max_bytes: int | None = None,
                 weights_format: str = NATIVE):
        import torch

        self.key = signing_key(key)
        self.weights_format = check_format(weights_format)
        self.max_bytes = max_bytes
        self._expect = None
        if expect is not None:
            sd = expect.state_dict() if isinstance(expect, torch.nn.Module) else dict(expect)
            self._expect = {k: (dtype_name(v.dtype), tuple(v.shape)) for k, v in sd.items()}
        self.store = SyncStore(root)
        self.io_workers = io_workers
        self.zstd = Zstd()
        self._scratch = Scratch()   # intermediate stages, reused
        self._staging = Scratch()   # per-tensor new bytes until commit, reused across versions
        self._token = 0
        self.version = version
        self.module = target if isinstance(target, torch.nn.Module) else None
        self._tensors: dict[str, Any] = {}
        if self.module is not None:
            self._tensors = dict(self.module.state_dict(keep_vars=True))
            self._tensors = {k: (v.data if isinstance(v, torch.nn.Parameter) else v)
                             for k, v in self._tensors.items()}
        elif target is not None:
            self._tensors = dict(target)
        for name, t in self._tensors.items():
            if not t.is_contiguous() or t.device.type != "cpu":
                raise InputError("receiver tensors must be contiguous CPU tensors", field=name)
        if version is not None and not self._tensors:
            raise InputError("version given without target weights", field="version")

    @property
    def state(self) -> dict[str, Any]:
        """The current weights (name -> tensor); module targets share the module's storage."""
        return dict(self._tensors)

    # -- reading -------------------------------------------------------------------------------
    def latest_version(self) -> int | None:
        """The newest published version, ``None`` if none yet; ``InputError`` naming the layout
        when the store holds another one (:func:`~skyrl_numerics.sync.manifest.readable_versions`)."""
        vs = readable_versions(self.store)
        return vs[-1] if vs else None

    def prepare(self, version: int) -> PreparedUpdate:
        """Read and verify ``version`` against the held weights; touches nothing."""
        t0 = time.perf_counter()
        m = read_manifest(self.store, version, key=self.key)
        src = manifest_path(version)
        if m.weights_format != self.weights_format:
            raise InputError(f"version {m.version} is published as weights_format {m.weights_format!r}; this "
                             f"receiver expects {self.weights_format!r}", field="weights_format", source=src)
        self._check_order(m, src)
        total = m.raw_nbytes
        if self.max_bytes is not None and total > self.max_bytes:
            raise InputError(f"version {m.version}: {total} raw bytes, more than max_bytes={self.max_bytes}",
                             field="tensors", source=src)
        if self._tensors:
            self._check_names(m, src)
        elif self._expect is not None:
            self._check_names(m, src, held=self._expect)
        self._token += 1
        prepared = PreparedUpdate(manifest=m, token=self._token)
        to_fetch = iter([e for e in m.tensors if e.payload is not None])
        io = _IOWindow(self.io_workers)
        try:
            for e in m.tensors:
                blob = None
                if e.payload is not None:
                    while not io.full() and (nxt := next(to_fetch, None)) is not None:
                        io.submit(self.store.read, nxt.payload, field=nxt.name)
                    blob = io.next()  # payloads come back in manifest order
                new = self._decode(m, e, blob, src)
                if new is not None:
                    prepared.new_bytes[e.name] = new
        finally:
            io.close()
        if self.weights_format != NATIVE:
            self._check_serving(m, prepared, src)
        prepared.fetch_s = time.perf_counter() - t0
        return prepared

    def _check_serving(self, m: Manifest, prepared: PreparedUpdate, src: str) -> None:
        """The state this version would leave, checked as a serving checkpoint (codes, scales,
        shapes, finite scales) before anything is committed."""
        after = {}
        for e in m.tensors:
            new = prepared.new_bytes.get(e.name)
            if new is None:
                after[e.name] = self._tensors[e.name]
            else:
                after[e.name] = tensor_from_bytes(new, dtype_from_name(e.dtype), e.shape)
        check_serving_tensors(after, m.weights_format, source=src)

    def _check_order(self, m: Manifest, src: str) -> None:
        cur = self.version
        if m.is_full:
            if cur is not None and m.version <= cur:
                raise InputError(f"out of order: receiver holds version {cur}, snapshot is "
                                 f"version {m.version}", field="version", source=src)
            return
        if cur is None:
            raise InputError(f"receiver holds no version; delta {m.version} needs base "
                             f"{m.base_version} (apply a full snapshot first)",
                             field="base_version", source=src)
        if m.version <= cur:
            raise InputError(f"out of order: receiver holds version {cur}, delta is version "
                             f"{m.version}", field="version", source=src)
        if m.base_version != cur:
            raise InputError(f"mismatched base: delta {m.version} is against version "
                             f"{m.base_version}, receiver holds {cur}", field="base_version",
                             source=src)

    def _check_names(self, m: Manifest, src: str, held=None) -> None:
        """Names, dtypes and shapes of the manifest against the held (or expected) weights."""
        if held is None:
            held = {k: (dtype_name(t.dtype), tuple(t.shape)) for k, t in self._tensors.items()}
        v = m.version
        for e in m.tensors:
            h = held.get(e.name)
            if h is None:
                raise InputError(f"version {v}: unknown tensor {e.name!r} (the receiver does not hold it)",
                                 field=e.name, source=src)
            if h[0] != e.dtype:
                raise InputError(f"version {v}, tensor {e.name!r}, field 'dtype': dtype {e.dtype}, receiver "
                                 f"holds {h[0]}", field=e.name, source=src)
            if h[1] != e.shape:
                raise InputError(f"version {v}, tensor {e.name!r}, field 'shape': shape {list(e.shape)}, "
                                 f"receiver holds {list(h[1])}", field=e.name, source=src)
        names = {e.name for e in m.tensors}
        missing = [n for n in held if n not in names]
        if missing:
            raise InputError(f"version {v}: tensor {missing[0]!r} held by the receiver is missing from the "
                             f"manifest ({len(missing)} missing)", field=missing[0], source=src)

    def _decode(self, m: Manifest, e: TensorEntry, blob: bytes | None,
                src: str) -> np.ndarray | None:
        """The verified new bytes of one tensor, or ``None`` if a delta left it unchanged."""
        if e.payload is None:
            old = tensor_bytes(self._tensors[e.name])
            if not verify_payload(old, e.checksum, e.name, src):
                raise InputError(f"tensor {e.name!r}: held bytes do not match the manifest "
                                 "checksum of an unchanged tensor (receiver is not at the base)",
                                 field=e.name, source=src)
            return None
        if len(blob) != e.payload_nbytes or not verify_payload(blob, e.payload_checksum, e.name, src):
            raise InputError(f"tensor {e.name!r}: payload {e.payload!r} is corrupt (checksum or "
                             f"size mismatch: {len(blob)} bytes, expected {e.payload_nbytes})",
                             field=e.name, source=src)
        shuf, xor = "shuffle" in m.filters, "xor" in m.filters
        itemsize = dtype_itemsize(dtype_from_name(e.dtype))
        shuffled = shuf and itemsize > 1 and e.nbytes % itemsize == 0
        # Only the last stage writes where the new bytes wait for commit: this tensor's staging
        # buffer (reused every version: no page faults in steady state), or fresh memory when a
        # fresh receiver adopts a snapshot.
        final = self._staging.get(e.name, e.nbytes) if self._tensors else None
        try:
            data = self.zstd.decompress(blob, e.nbytes,
                                        out=self._scratch.get("z", e.nbytes)
                                        if (shuffled or xor) else final)
        except ValueError as err:
            raise InputError(f"tensor {e.name!r}: payload does not decode ({err})",
                             field=e.name, source=src) from None
        if shuffled:
            data = unshuffle(data, itemsize,
                             out=self._scratch.get("unshuffle", e.nbytes) if xor else final)
        if xor:
            data = xor_bytes(data, tensor_bytes(self._tensors[e.name]), out=final)
        if not verify_payload(data, e.checksum, e.name, src):
            raise InputError(f"tensor {e.name!r}: checksum mismatch after decoding (the held "
                             "weights are not the manifest's base, or the payload is corrupt)",
                             field=e.name, source=src)
        return data

    # -- applying ------------------------------------------------------------------------------
    def commit(self, prepared: PreparedUpdate) -> Manifest:
        """Copy a prepared version in. Re-checks order (the weights may have moved since)."""
        m = prepared.manifest
        self._check_order(m, manifest_path(m.version))
        if self._tensors and prepared.token != self._token:
            raise InputError(f"stale update for version {m.version}: a later prepare() reused "
                             "its buffers; prepare it again", field="prepared")
        if not self._tensors:  # a fresh receiver adopts the snapshot's tensors as its own
            self._tensors = {e.name: tensor_from_bytes(prepared.new_bytes[e.name],
                                                       dtype_from_name(e.dtype), e.shape)
                             for e in m.tensors}
        else:
            for name, new in prepared.new_bytes.items():
                np.copyto(tensor_bytes(self._tensors[name]), new)
        self.version = m.version
        return m

    def apply(self, version: int) -> Manifest:
        """``commit(prepare(version))``: all-or-nothing."""
        return self.commit(self.prepare(version))

    def sync(self) -> list[Manifest]:
        """Apply every published version after the held one, in order; returns their manifests.

        When the next version is not there (a fresh receiver, or versions pruned) it jumps to the
        newest full snapshot newer than what it holds, then continues by deltas. Errors propagate
        with the last good weights kept. A store that holds another layout (SkyRL's
        ``delta-%08d/manifest.json``, a sharded store, anything else) and no version of ours is an
        ``InputError`` naming what it found and what it expects, not an empty list.
        """
        applied: list[Manifest] = []
        versions = readable_versions(self.store)
        while True:
            cur = self.version
            if cur is not None and cur + 1 in versions:
                applied.append(self.apply(cur + 1))
                continue
            fulls = [v for v in versions
                     if (cur is None or v > cur) and read_manifest(self.store, v, key=self.key).is_full]
            if not fulls:
                return applied
            applied.append(self.apply(fulls[-1]))
