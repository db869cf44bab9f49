"""SkyRL 0.4's checkpoint-delta store: its layout, its manifest (strictly parsed), its payload files.

SkyRL 0.4.0 (``skyrl/backends/skyrl_train/weight_sync/delta/checkpoint.py``:
``DeltaCheckpointPublisher`` writes, ``LocalCheckpointStore`` reads) keeps, under ``sync_dir``::

    delta-%08d/delta-rank%05d-file%06d.safetensors   payloads: 1-D uint8 tensors, key = tensor name
    delta-%08d/manifest.json                         written last

Version 0 is the base checkpoint itself (``base_model_path``: its ``*.safetensors``); it is never in
the store. Version ``v >= 1`` is a delta against ``v - 1`` that lists only the tensors whose bytes
changed; for each, with ``b_v`` the tensor's raw bytes in the checkpoint's dtype::

    payload  = zstd_level1(b_v XOR b_{v-1})          raw bytes: no byte shuffle (ours shuffles)
    checksum = xxh3_128(b_v).hexdigest()             of the NEW bytes ("sha256" also allowed)

so ``b_v = zstd^-1(payload) XOR b_{v-1}`` bit for bit — the same XOR bytes and xxh3-128 values as
our own store (``weight_sync.py``), in another container. ``manifest.json``::

    {"version": v, "base_version": v - 1,
     "tensors": [{"name", "dtype" (torch name), "shape", "uncompressed_num_bytes",
                  "compressed_num_bytes", "payload_file", "payload_key", "checksum",
                  "checksum_algorithm"}, ...],
     "total_uncompressed_num_bytes", "total_compressed_num_bytes", "payload_files": [...]}

What a reader can check (:func:`parse_manifest`, ``skyrl_receiver.py``): exact JSON types, no
unknown fields, ``version`` = the folder's number and ``base_version = version - 1``, each
tensor's ``uncompressed_num_bytes`` = numel x itemsize of its dtype and shape, totals = sums,
payload file names of the one pattern above (no path traversal) and listed in ``payload_files``,
the payload's length = ``compressed_num_bytes``, zstd decoding to exactly the raw size, names /
dtypes / shapes against the weights held, and the checksum of every changed tensor's new bytes.
What it cannot: the manifest has no digest and no signature (an edited manifest is caught only
through what it implies), unchanged tensors are omitted (nothing vouches for them), payload files
carry no digest of their own (a corrupt payload is caught by zstd or by the tensor checksum after
decoding). A receiver that requires signed manifests therefore refuses this format.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

from skyrl_numerics.errors import InputError
from skyrl_numerics.sync.entry_fields import MAX_TENSOR_BYTES, EntryFields, is_int
from skyrl_numerics.sync.manifest import MAX_TENSORS
from skyrl_numerics.sync.store import SyncStore

MANIFEST = "manifest.json"
CHECKSUM_HEX = {"xxh3-128": 32, "sha256": 64}
LAYOUT = ("delta-%08d/manifest.json + delta-%08d/delta-rank%05d-file%06d.safetensors "
          "(SkyRL 0.4 DeltaCheckpointPublisher; version 0 = the base checkpoint)")
_DIR_RE = re.compile(r"^delta-(\d{8})$")
_FILE_RE = re.compile(r"^delta-rank\d{5}-file\d{6}\.safetensors$")
_TOP_KEYS = ("version", "base_version", "tensors", "total_uncompressed_num_bytes",
             "total_compressed_num_bytes", "payload_files")
_ENTRY_KEYS = ("name", "dtype", "shape", "uncompressed_num_bytes", "compressed_num_bytes",
               "payload_file", "payload_key", "checksum", "checksum_algorithm")


def version_dir(version: int) -> str:
    return f"delta-{version:08d}"


def manifest_rel(version: int) -> str:
    return f"{version_dir(version)}/{MANIFEST}"


def payload_file_name(rank: int, index: int) -> str:
    return f"delta-rank{rank:05d}-file{index:06d}.safetensors"


@dataclass(frozen=True)
class SkyrlEntry:
    """One changed tensor of one version (SkyRL's ``DeltaTensorRecord``)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    uncompressed_num_bytes: int     # raw bytes of the tensor
    compressed_num_bytes: int       # bytes of its zstd payload
    payload_file: str               # file under delta-%08d/
    payload_key: str                # the uint8 tensor's key inside that file
    checksum: str                   # hex digest of the tensor's NEW raw bytes
    checksum_algorithm: str = "xxh3-128"

    @property
    def digest(self) -> str:
        """The checksum as our ``<algo>:<hex>`` (``codec.verify`` reads it)."""
        return f"{self.checksum_algorithm}:{self.checksum}"


@dataclass(frozen=True)
class SkyrlManifest:
    version: int
    base_version: int
    tensors: tuple[SkyrlEntry, ...]
    payload_files: tuple[str, ...]

    @property
    def payload_nbytes(self) -> int:
        return sum(e.compressed_num_bytes for e in self.tensors)

    @property
    def raw_nbytes(self) -> int:
        return sum(e.uncompressed_num_bytes for e in self.tensors)

    @property
    def changed(self) -> list[str]:
        return [e.name for e in self.tensors]

    def to_json(self) -> bytes:
        """The manifest as SkyRL writes it (``DeltaManifest.to_json``, key order kept)."""
        tensors = [dict(asdict(e), shape=list(e.shape)) for e in self.tensors]
        return json.dumps({"version": self.version, "base_version": self.base_version,
                           "tensors": tensors, "total_uncompressed_num_bytes": self.raw_nbytes,
                           "total_compressed_num_bytes": self.payload_nbytes,
                           "payload_files": list(self.payload_files)}).encode()


def _load_json(data: bytes, bad):
    try:
        d = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise bad(f"not valid JSON ({' '.join(str(e).split())[:120]})") from None
    if not isinstance(d, dict):
        raise bad("manifest is not a JSON object")
    return d


def parse_manifest(data: bytes, version: int) -> SkyrlManifest:
    """Parse and schema-check ``delta-<version>/manifest.json``; ``InputError`` naming the file,
    the tensor and the field."""
    src = manifest_rel(version)

    def bad(msg, field=None, index=None):
        return InputError(msg, field=field, index=index, source=src)

    d = _load_json(data, bad)
    for k in d:
        if k not in _TOP_KEYS:
            raise bad(f"unknown field {k!r} (SkyRL 0.4 manifests hold {', '.join(_TOP_KEYS)})", field=k)
    for k in _TOP_KEYS:
        if k not in d:
            raise bad("missing field", field=k)
    v, b = d["version"], d["base_version"]
    if not is_int(v) or v != version:
        raise bad(f"version {v!r}, but the folder is {version_dir(version)}", field="version")
    if not is_int(b) or b != v - 1:
        raise bad(f"version {v}: base_version {b!r}; SkyRL deltas chain v - 1 -> v", field="base_version")
    files = d["payload_files"]
    if (not isinstance(files, list) or len(set(map(str, files))) != len(files)
            or not all(isinstance(f, str) and _FILE_RE.match(f) for f in files)):
        raise bad(f"version {v}: payload_files {files!r} is not a list of distinct "
                  "delta-rank%05d-file%06d.safetensors names", field="payload_files")
    raw = d["tensors"]
    if not isinstance(raw, list) or len(raw) > MAX_TENSORS:
        raise bad(f"version {v}: 'tensors' is not a list of at most {MAX_TENSORS}", field="tensors")
    entries, seen = [], set()
    for i, t in enumerate(raw):
        e = _parse_entry(t, i, v, src, set(files))
        if e.name in seen:
            raise bad(f"version {v}: tensor {e.name!r} listed twice", field="tensors", index=i)
        seen.add(e.name)
        entries.append(e)
    m = SkyrlManifest(version=v, base_version=b, tensors=tuple(entries), payload_files=tuple(files))
    for key, total in (("total_uncompressed_num_bytes", m.raw_nbytes),
                       ("total_compressed_num_bytes", m.payload_nbytes)):
        if not is_int(d[key]) or d[key] != total:
            raise bad(f"version {v}: {key} {d[key]!r} is not the sum over the tensors ({total})", field=key)
    return m


def _parse_entry(t, i: int, version: int, src: str, files: set) -> SkyrlEntry:
    e = EntryFields.of(t, i, version, src, _ENTRY_KEYS)
    name, bad = e.name, e.bad
    shape = e.shape()
    n = e.nbytes("uncompressed_num_bytes", e.dtype(), shape)
    c = t["compressed_num_bytes"]
    if not is_int(c) or not 0 < c <= MAX_TENSOR_BYTES:
        raise bad("compressed_num_bytes", f"{c!r} is not a positive integer")
    if t["payload_file"] not in files:
        raise bad("payload_file", f"{t['payload_file']!r} is not one of the version's payload_files")
    if not isinstance(t["payload_key"], str) or not t["payload_key"]:
        raise bad("payload_key", f"{t['payload_key']!r} is not a non-empty string")
    algo, hx = t["checksum_algorithm"], t["checksum"]
    if algo not in CHECKSUM_HEX:
        raise bad("checksum_algorithm", f"{algo!r} is not one of {', '.join(CHECKSUM_HEX)}")
    if (not isinstance(hx, str) or len(hx) != CHECKSUM_HEX[algo]
            or not all(ch in "0123456789abcdef" for ch in hx)):
        raise bad("checksum", f"{hx!r} is not a {algo} hex digest")
    return SkyrlEntry(name=name, dtype=t["dtype"], shape=tuple(shape), uncompressed_num_bytes=n,
                      compressed_num_bytes=c, payload_file=t["payload_file"],
                      payload_key=t["payload_key"], checksum=hx, checksum_algorithm=algo)


def list_versions(store: SyncStore) -> list[int]:
    """Versions with a ``delta-%08d/manifest.json`` in ``store``, ascending."""
    out = []
    for name in store.list(""):
        m = _DIR_RE.match(name)
        if m and store.exists(f"{name}/{MANIFEST}"):
            out.append(int(m.group(1)))
    return sorted(out)


def read_payload_file(store: SyncStore, version: int, name: str) -> dict:
    """``{payload_key: uint8 tensor}`` of one payload file; ``InputError`` naming the file when it
    is missing or not a safetensors file of 1-D uint8 tensors."""
    import torch
    from safetensors.torch import load

    rel = f"{version_dir(version)}/{name}"
    data = store.read(rel, field="payload_file")
    try:
        out = load(data)
    except Exception as e:   # safetensors raises its own error type for every bad header
        raise InputError(f"payload file is not a safetensors file ({' '.join(str(e).split())[:120]})",
                         field="payload_file", source=rel) from None
    for key, t in out.items():
        if t.dtype != torch.uint8 or t.dim() != 1:
            raise InputError(f"payload {key!r} is {t.dtype}{list(t.shape)}, expected 1-D uint8",
                             field=key, source=rel)
    return out
