"""Apply a SkyRL 0.4 checkpoint-delta store (``skyrl_layout.py``) to weights held in memory.

``SkyrlDeltaReceiver(root, base)`` holds version 0 — the base checkpoint SkyRL's publisher diffs
against (a checkpoint directory, whose ``*.safetensors`` are read, or a state dict) — and brings it
forward one version at a time::

    b_v(name) = zstd^-1(payload_v(name)) XOR b_{v-1}(name)     for every name the manifest lists
    b_v(name) = b_{v-1}(name)                                  for every other name (omitted)

``prepare(target)`` reads and checks the whole chain ``held + 1 .. target`` (each manifest, the
order and every gap, names / dtypes / shapes against the held weights, payload sizes, zstd, and
the checksum of every new tensor; ``skyrl_layout.py`` lists what the format cannot vouch for)
without touching the weights; ``commit`` copies the new bytes in. On any error nothing changes.
A receiver with a sync key (argument or ``$SKYRL_NUMERICS_SYNC_KEY``) refuses the format: its
manifests carry no signature.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from skyrl_numerics.errors import InputError
from skyrl_numerics.sync.codec import (Zstd, dtype_name, tensor_bytes, verify, xor_bytes)
from skyrl_numerics.sync.manifest import KEY_ENV, signing_key
from skyrl_numerics.sync.skyrl_layout import (LAYOUT, SkyrlManifest, list_versions, manifest_rel,
                                              parse_manifest, read_payload_file, version_dir)
from skyrl_numerics.sync.store import SyncStore


@dataclass
class SkyrlPrepared:
    """A verified chain of versions, ready to commit: the final bytes of every changed tensor."""

    base_version: int                      # the version held when it was prepared
    version: int                           # the version it brings the weights to
    manifests: list[SkyrlManifest]
    new_bytes: dict[str, np.ndarray] = field(default_factory=dict)
    root: str = ""
    fetch_s: float = 0.0

    @property
    def payload_nbytes(self) -> int:
        return sum(m.payload_nbytes for m in self.manifests)


def load_checkpoint(base) -> dict:
    """``{name: tensor}`` of a checkpoint directory's ``*.safetensors`` (or a state dict, kept)."""
    from safetensors.torch import load_file

    if isinstance(base, dict):
        return dict(base)
    files = sorted(p for p in os.listdir(base) if p.endswith(".safetensors"))
    if not files:
        raise InputError(f"{base} has no *.safetensors: SkyRL's version 0 is the base checkpoint",
                         field="base_model_path")
    out = {}
    for f in files:
        out.update(load_file(os.path.join(base, f)))
    return out


def _root_of(root, uri, target: int):
    """The store root from SkyRL's ``sync_dir`` and/or ``uri`` (= ``<sync_dir>/delta-<target>``)."""
    if uri is None:
        return root
    parent, _, last = str(uri).rstrip("/").rpartition("/")
    if last != version_dir(target) or not parent:
        raise InputError(f"uri {uri!r} is not <sync_dir>/{version_dir(target)}", field="uri")
    if root is not None and str(root).rstrip("/") != parent:
        raise InputError(f"uri {uri!r} is not under sync_dir {root!r}", field="uri")
    return parent


class SkyrlDeltaReceiver:
    """Holds the weights of one SkyRL checkpoint-delta stream (see the module docstring).

    ``root``: the store (``sync_dir``: path or fsspec URL; ``prepare`` may name another one).
    ``base``: the base checkpoint directory or state dict (version 0), held as contiguous CPU
    tensors. ``io_workers``: payload files read at once (SkyRL's ``cloud_download_workers``)."""

    def __init__(self, root=None, base=None, *, key=None, io_workers: int = 4):
        if signing_key(key) is not None:
            raise InputError("a SkyRL checkpoint-delta store has no manifest digest or signature, and "
                             f"this receiver requires signed manifests (a sync key is set: {KEY_ENV} "
                             "or --sync-key); publish with skyrl_numerics' DeltaPublisher instead",
                             field="signature")
        if base is None:
            raise InputError("a SkyRL store needs its base checkpoint (version 0): pass base=",
                             field="base_model_path")
        self.root = None if root is None else str(root)
        self._tensors = {}
        for name, t in load_checkpoint(base).items():
            if t.device.type != "cpu" or not t.is_contiguous():
                raise InputError("base tensors must be contiguous CPU tensors", field=name)
            self._tensors[name] = t
        self.version = 0
        self.io_workers = max(int(io_workers), 1)
        self.zstd = Zstd()

    @property
    def state(self) -> dict:
        return dict(self._tensors)

    def _store(self, root) -> SyncStore:
        root = root if root is not None else self.root
        if not root:
            raise InputError("no store named: pass the SkyRL sync_dir", field="sync_dir")
        return SyncStore(root)

    def latest_version(self, root=None) -> int | None:
        vs = list_versions(self._store(root))
        return vs[-1] if vs else None

    def sync(self, root=None) -> SkyrlPrepared | None:
        """Apply every version after the held one (``None`` when there is none)."""
        newest = self.latest_version(root)
        if newest is None:
            raise InputError(f"no version under {self._store(root).url}: expected {LAYOUT}",
                             field="root")
        if newest == self.version:
            return None
        return self.commit(self.prepare(newest, root))

    # -- reading ---------------------------------------------------------------------------------
    def prepare(self, target: int, root=None, uri=None) -> SkyrlPrepared:
        """Read and verify versions ``held + 1 .. target``; touches nothing. ``uri``: SkyRL's name
        of the target's folder, ``<sync_dir>/delta-<target:08d>`` (it must be exactly that)."""
        t0 = time.perf_counter()
        if isinstance(target, bool) or not isinstance(target, int):
            raise InputError(f"target_version {target!r} is not an integer", field="target_version")
        store = self._store(_root_of(root, uri, target))
        if target <= self.version:
            raise InputError(f"out of order: this receiver holds version {self.version}; version "
                             f"{target} is not newer", field="target_version")
        prepared = SkyrlPrepared(base_version=self.version, version=target, manifests=[],
                                 root=store.url)
        for v in range(self.version + 1, target + 1):
            rel = manifest_rel(v)
            if not store.exists(rel):
                raise InputError(f"version gap: {rel} is missing under {store.url} (this receiver "
                                 f"holds version {self.version}; version {target} needs every "
                                 "version between)", field="target_version", source=rel)
            m = parse_manifest(store.read(rel, field="manifest"), v)
            self._check_names(m)
            self._decode_version(store, m, prepared)
            prepared.manifests.append(m)
        prepared.fetch_s = time.perf_counter() - t0
        return prepared

    def _check_names(self, m: SkyrlManifest) -> None:
        src = manifest_rel(m.version)
        for i, e in enumerate(m.tensors):
            held = self._tensors.get(e.name)
            if held is None:
                raise InputError(f"version {m.version}: unknown tensor {e.name!r} (the served "
                                 "model has no such tensor)", field=e.name, index=i, source=src)
            if dtype_name(held.dtype) != e.dtype:
                raise InputError(f"version {m.version}, tensor {e.name!r}, field 'dtype': dtype "
                                 f"{e.dtype}, the model holds {dtype_name(held.dtype)}",
                                 field=e.name, index=i, source=src)
            if tuple(held.shape) != e.shape:
                raise InputError(f"version {m.version}, tensor {e.name!r}, field 'shape': shape "
                                 f"{list(e.shape)}, the model holds {list(held.shape)}",
                                 field=e.name, index=i, source=src)

    def _read_files(self, store: SyncStore, m: SkyrlManifest) -> dict:
        """``{file name: {payload_key: uint8 tensor}}`` of the files the version's tensors name."""
        needed = sorted({e.payload_file for e in m.tensors})
        with ThreadPoolExecutor(min(self.io_workers, max(len(needed), 1))) as pool:
            return dict(zip(needed, pool.map(lambda f: read_payload_file(store, m.version, f), needed)))

    def _decode_version(self, store: SyncStore, m: SkyrlManifest, prepared: SkyrlPrepared) -> None:
        files = self._read_files(store, m)
        for e in m.tensors:
            src = f"{version_dir(m.version)}/{e.payload_file}"
            blob = files[e.payload_file].get(e.payload_key)
            if blob is None:
                raise InputError(f"version {m.version}, tensor {e.name!r}: payload key "
                                 f"{e.payload_key!r} is not in {e.payload_file}", field=e.name, source=src)
            blob = blob.numpy()
            if blob.size != e.compressed_num_bytes:
                raise InputError(f"version {m.version}, tensor {e.name!r}: payload is {blob.size} bytes, "
                                 f"the manifest says {e.compressed_num_bytes}", field=e.name, source=src)
            try:
                patch = self.zstd.decompress(memoryview(blob), e.uncompressed_num_bytes)
            except ValueError as err:
                raise InputError(f"version {m.version}, tensor {e.name!r}: payload does not decode "
                                 f"({err})", field=e.name, source=src) from None
            old = prepared.new_bytes.get(e.name)
            if old is None:
                old = tensor_bytes(self._tensors[e.name])
            new = xor_bytes(patch, old, out=patch)
            if not verify(new, e.digest):
                raise InputError(f"version {m.version}, tensor {e.name!r}: checksum mismatch after "
                                 "decoding (the payload is corrupt, or the held weights are not the "
                                 f"base version {m.base_version})", field=e.name, source=src)
            prepared.new_bytes[e.name] = new

    # -- applying --------------------------------------------------------------------------------
    def commit(self, prepared: SkyrlPrepared) -> SkyrlPrepared:
        """Copy a prepared chain in (refused if the held version moved since it was prepared)."""
        if prepared.base_version != self.version:
            raise InputError(f"stale update: prepared against version {prepared.base_version}, the "
                             f"receiver now holds {self.version}; prepare it again", field="prepared")
        for name, new in prepared.new_bytes.items():
            np.copyto(tensor_bytes(self._tensors[name]), new)
        self.version = prepared.version
        return prepared
