"""The weight-sync manifest: schema, strict parsing, digest and HMAC signature, store paths.

One manifest per version, ``manifests/<v:012d>.json`` (schema: ``docs/weight_sync.md``). Every
manifest carries ``manifest_digest``, the digest of its canonical JSON (every other field: names,
dtypes, shapes, sizes, versions, payload paths and digests), checked before anything else is
read; with a shared key (argument or ``$SKYRL_NUMERICS_SYNC_KEY``) also ``signature`` =
HMAC-SHA256 of the same bytes. :meth:`Manifest.from_json` refuses any field of the wrong type or
range, naming the tensor and field. The publisher and receiver are ``weight_sync.py``.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import re
from dataclasses import asdict, dataclass
from typing import Any

from skyrl_numerics.errors import InputError
from skyrl_numerics.hashing import DIGEST_ALGOS
from skyrl_numerics.sync.codec import digest, verify
from skyrl_numerics.sync.entry_fields import MAX_TENSOR_BYTES, EntryFields, is_int
from skyrl_numerics.sync.serving import NATIVE, WEIGHTS_FORMATS
from skyrl_numerics.sync.store import SyncStore

FORMAT = "skyrl-numerics.weight-sync"
FORMAT_VERSION = 2            # 2: manifest_digest (+ optional HMAC signature), strict field types
_MANIFEST_RE = re.compile(r"^(\d{12})\.json$")
CHECKSUM_ALGOS = DIGEST_ALGOS
KEY_ENV = "SKYRL_NUMERICS_SYNC_KEY"
SIGNATURE_ALGO = "hmac-sha256"
MAX_TENSORS = 1 << 20
_TOP_KEYS = ("version", "base_version", "tensors", "codec", "level", "filters", "created_unix",
             "format", "format_version", "manifest_digest", "signature", "weights_format")
_ENTRY_KEYS = ("name", "dtype", "shape", "nbytes", "checksum", "payload", "payload_nbytes",
               "payload_checksum")
_HEX_LEN = {"xxh3-128": 32, "blake2b-128": 32}


def signing_key(key) -> bytes | None:
    """The shared signing key: ``key`` (bytes or str) or the ``SKYRL_NUMERICS_SYNC_KEY`` env var."""
    if key is None:
        key = os.environ.get(KEY_ENV) or None
    if key is None:
        return None
    if isinstance(key, str):
        key = key.encode()
    if not isinstance(key, (bytes, bytearray)) or len(key) == 0:
        raise InputError("signing key must be non-empty bytes or str", field="key")
    return bytes(key)


def _canonical(d: dict) -> bytes:
    """The signed/digested bytes: every field except the digest and signature, canonical JSON."""
    body = {k: v for k, v in d.items() if k not in ("manifest_digest", "signature")}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def manifest_digest(d: dict, algo: str | None = None) -> str:
    return digest(_canonical(d), algo)


def manifest_signature(d: dict, key: bytes) -> str:
    return f"{SIGNATURE_ALGO}:{hmac.new(key, _canonical(d), hashlib.sha256).hexdigest()}"


def seal(d: dict, key=None) -> dict:
    """Set ``manifest_digest`` (and ``signature`` with a key) of a manifest dict, in place."""
    d.pop("signature", None)
    d["manifest_digest"] = manifest_digest(d)
    k = signing_key(key)
    if k is not None:
        d["signature"] = manifest_signature(d, k)
    return d


def _is_checksum(x) -> bool:
    if not isinstance(x, str):
        return False
    algo, sep, hx = x.partition(":")
    return bool(sep) and algo in _HEX_LEN and len(hx) == _HEX_LEN[algo] and all(c in "0123456789abcdef" for c in hx)


def manifest_path(version: int) -> str:
    return f"manifests/{version:012d}.json"


def payload_dir(version: int) -> str:
    return f"payloads/{version:012d}"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of one version. ``payload`` is ``None`` when a delta left it unchanged."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int                    # raw bytes of the tensor
    checksum: str                  # digest of the tensor's NEW raw bytes
    payload: str | None            # relative path of the compressed payload
    payload_nbytes: int            # compressed bytes (0 without payload)
    payload_checksum: str | None   # digest of the payload file's bytes


@dataclass(frozen=True)
class Manifest:
    version: int
    base_version: int | None       # None: a full snapshot
    tensors: tuple[TensorEntry, ...]
    codec: str = "zstd"
    level: int = 1
    filters: tuple[str, ...] = ()  # applied in order before the codec: "xor", "shuffle"
    created_unix: float = 0.0
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    weights_format: str = NATIVE   # "native" (tensors as given) or a serving format (serving.py)

    @property
    def is_full(self) -> bool:
        return self.base_version is None

    @property
    def raw_nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def payload_nbytes(self) -> int:
        return sum(t.payload_nbytes for t in self.tensors)

    @property
    def changed(self) -> list[str]:
        """Names with a payload (all of them in a full snapshot)."""
        return [t.name for t in self.tensors if t.payload is not None]

    def to_json(self, key=None) -> bytes:
        """Canonical manifest JSON with ``manifest_digest`` (and ``signature`` given a key)."""
        d = asdict(self)
        d["tensors"] = [dict(asdict(t), shape=list(t.shape)) for t in self.tensors]
        d["filters"] = list(self.filters)
        seal(d, key)
        return json.dumps(d, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes, *, source: str = "manifest", key=None) -> "Manifest":
        """Parse, authenticate and schema-check a manifest; ``InputError`` naming the version,
        tensor and field. The digest (and, with a key, the signature) is checked before any
        field is interpreted."""
        def bad(msg, field=None, index=None):
            return InputError(msg, field=field, index=index, source=source)

        try:
            d = json.loads(data)
        except json.JSONDecodeError as e:
            raise bad(f"not valid JSON ({e.msg} at {e.pos})") from None
        except (ValueError, RecursionError) as e:     # bad UTF-8, int digit limit, nesting
            what = "nested too deeply" if isinstance(e, RecursionError) else " ".join(str(e).split())[:120]
            raise bad(f"not valid JSON ({what})") from None
        if not isinstance(d, dict):
            raise bad("manifest is not a JSON object")
        if d.get("format") != FORMAT or not is_int(d.get("format_version")) or d["format_version"] != FORMAT_VERSION:
            raise bad(f"format {d.get('format')!r} v{d.get('format_version')!r}, expected "
                      f"{FORMAT!r} v{FORMAT_VERSION}", field="format")
        for k in d:
            if k not in _TOP_KEYS:
                raise bad(f"unknown field {k!r}", field=k)
        md = d.get("manifest_digest")
        if not _is_checksum(md):
            raise bad(f"manifest_digest {md!r} is missing or not <algo>:<hex>", field="manifest_digest")
        if not verify_payload(_canonical(d), md, "manifest", source):
            raise bad("manifest digest mismatch: names, dtypes, shapes, versions or payload digests "
                      "were changed after publishing", field="manifest_digest")
        k = signing_key(key)
        if k is not None:
            sig = d.get("signature")
            if sig is None:
                raise bad("manifest is not signed and this receiver requires a signature", field="signature")
            if not isinstance(sig, str) or not hmac.compare_digest(sig, manifest_signature(d, k)):
                raise bad("manifest signature does not verify with the shared key", field="signature")
        elif "signature" in d and not isinstance(d["signature"], str):
            raise bad("signature is not a string", field="signature")
        v, b = d.get("version"), d.get("base_version")
        if not is_int(v) or not 0 <= v < 1 << 62:
            raise bad(f"version {v!r} is not a non-negative integer", field="version")
        if b is not None and (not is_int(b) or not 0 <= b < v):
            raise bad(f"version {v}: base_version {b!r} is not an integer in [0, {v})", field="base_version")
        if d.get("codec") != "zstd":
            raise bad(f"version {v}: codec {d.get('codec')!r}, expected 'zstd'", field="codec")
        level = d.get("level", 1)
        if not is_int(level) or not -131072 <= level <= 22:
            raise bad(f"version {v}: level {level!r} is not a zstd level", field="level")
        created = d.get("created_unix", 0.0)
        if isinstance(created, bool) or not isinstance(created, (int, float)) or not math.isfinite(created):
            raise bad(f"version {v}: created_unix {created!r} is not a finite number", field="created_unix")
        filters = d.get("filters", [])
        if not isinstance(filters, list) or not all(isinstance(f, str) for f in filters):
            raise bad(f"version {v}: filters {filters!r} is not a list of names", field="filters")
        filters = tuple(filters)
        wf = d.get("weights_format", NATIVE)   # manifests written before the field: native
        if not isinstance(wf, str) or wf not in WEIGHTS_FORMATS:
            raise bad(f"version {v}: weights_format {wf!r} is not one of {', '.join(WEIGHTS_FORMATS)}",
                      field="weights_format")
        if (not set(filters) <= {"xor", "shuffle"} or len(set(filters)) != len(filters)
                or (("xor" in filters) != (b is not None))):
            raise bad(f"version {v}: filters {list(filters)} do not fit a "
                      f"{'full snapshot' if b is None else 'delta'}", field="filters")
        raw = d.get("tensors")
        if not isinstance(raw, list):
            raise bad(f"version {v}: 'tensors' is not a list", field="tensors")
        if not raw:
            raise bad(f"version {v}: no tensors", field="tensors")
        if len(raw) > MAX_TENSORS:
            raise bad(f"version {v}: {len(raw)} tensors (more than {MAX_TENSORS})", field="tensors")
        entries, seen = [], set()
        for i, t in enumerate(raw):
            entries.append(_parse_entry(t, i, source, delta=b is not None, version=v))
            if entries[-1].name in seen:
                raise bad(f"version {v}: tensor {entries[-1].name!r} listed twice", field="tensors", index=i)
            seen.add(entries[-1].name)
        return cls(version=v, base_version=b, tensors=tuple(entries), codec="zstd",
                   level=level, filters=filters, created_unix=float(created), weights_format=wf)


_PAYLOAD_RE = re.compile(r"^payloads/(\d{12})/\d{6}\.zst$")


def _parse_entry(t: Any, i: int, source: str, *, delta: bool, version: int) -> TensorEntry:
    e = EntryFields.of(t, i, version, source, _ENTRY_KEYS)
    name, bad = e.name, e.bad
    shape = e.shape()
    nbytes = e.nbytes("nbytes", e.dtype(), shape)
    if not _is_checksum(t["checksum"]):
        raise bad("checksum", f"checksum {t['checksum']!r} is not one of {'/'.join(CHECKSUM_ALGOS)}:<hex>")
    payload, pn, pc = t["payload"], t["payload_nbytes"], t["payload_checksum"]
    if payload is None:
        if not delta:
            raise bad("payload", "a full snapshot needs a payload")
        if pn != 0 or isinstance(pn, bool) or pc is not None:
            raise bad("payload_nbytes", "no payload: payload_nbytes must be 0 and payload_checksum null")
    else:
        m = _PAYLOAD_RE.match(payload) if isinstance(payload, str) else None
        if m is None or int(m.group(1)) != version:
            raise bad("payload", f"{payload!r} is not payloads/{version:012d}/<index>.zst")
        if not is_int(pn) or not 0 < pn <= MAX_TENSOR_BYTES:
            raise bad("payload_nbytes", f"{pn!r} is not a positive integer <= {MAX_TENSOR_BYTES}")
        if not _is_checksum(pc):
            raise bad("payload_checksum", f"payload_checksum {pc!r} is not one of {'/'.join(CHECKSUM_ALGOS)}:<hex>")
    return TensorEntry(name=name, dtype=t["dtype"], shape=tuple(shape), nbytes=nbytes, checksum=t["checksum"],
                       payload=payload, payload_nbytes=pn, payload_checksum=pc)


def list_versions(store: SyncStore) -> list[int]:
    """Versions whose manifest exists in ``store``, ascending."""
    out = []
    for name in store.list("manifests"):
        m = _MANIFEST_RE.match(name)
        if m:
            out.append(int(m.group(1)))
    return sorted(out)


#: the layout :func:`list_versions` reads, as the errors name it
LAYOUT = "manifests/<version:012d>.json + payloads/<version:012d>/ (skyrl-numerics DeltaPublisher)"
_OURS = ("manifests", "payloads")
_SKYRL_DELTA_RE = re.compile(r"^delta-\d{8}$")


def foreign_layout(store: SyncStore) -> str | None:
    """What the root of a store without a readable version holds instead, in words; ``None`` when
    it holds nothing (no publish yet) or only this layout's folders (a publish under way).

    Recognized: SkyRL's checkpoint-delta store (``delta-%08d/manifest.json``, SkyRL 0.4.0
    ``DeltaCheckpointPublisher``) and this package's sharded store (``versions/`` + ``links/``);
    anything else is named by its first entries."""
    names = [n for n in store.list("") if not n.startswith(".")]
    if not names or any(n in _OURS for n in names):
        return None
    skyrl = [n for n in names if _SKYRL_DELTA_RE.match(n) and store.exists(f"{n}/manifest.json")]
    if skyrl:
        return (f"a SkyRL checkpoint-delta store (delta-%08d/manifest.json, {len(skyrl)} version(s): "
                f"{skyrl[0]}/manifest.json ...): read it with sync.skyrl_receiver.SkyrlDeltaReceiver("
                "root, base=<its base checkpoint>)")
    if "versions" in names or "links" in names:
        return ("a skyrl-numerics sharded store (versions/<v:012d>.json + links/s<S>-d<D>/): read it with "
                "sync.sharded.ShardedReceiver, or point a DeltaReceiver at one links/ folder")
    return f"{len(names)} entries of no weight-sync layout known here ({', '.join(names[:3])} ...)"


def readable_versions(store: SyncStore) -> list[int]:
    """:func:`list_versions`, or ``InputError`` naming the layout found and the one expected when
    the store holds something else (a receiver pointed at it would otherwise apply nothing, silently)."""
    versions = list_versions(store)
    if not versions:
        found = foreign_layout(store)
        if found is not None:
            raise InputError(f"no version this receiver can read under {store.url}: found {found}; expected "
                             f"{LAYOUT}", field="root")
    return versions


def read_manifest(store: SyncStore, version: int, *, key=None) -> Manifest:
    rel = manifest_path(version)
    m = Manifest.from_json(store.read(rel, field="manifest"), source=rel, key=key)
    if m.version != version:
        raise InputError(f"file says version {m.version}", field="version", source=rel)
    return m


def verify_payload(buf, checksum: str, name: str, src: str) -> bool:
    try:
        return verify(buf, checksum)
    except ImportError:
        raise InputError(f"tensor {name!r}: checksum {checksum.partition(':')[0]} needs the "
                         "xxhash package (pip install xxhash)", field=name, source=src) from None


