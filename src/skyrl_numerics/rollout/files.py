"""Rollout files: :meth:`Rollout.save` / :meth:`Rollout.load` (mixed into
:class:`~skyrl_numerics.rollout.Rollout` by :class:`RolloutFiles`), the schema and the content digest.

File formats (see docs/gap.md, "Rollout files"):

- ``.safetensors``: the arrays of :mod:`skyrl_numerics.rollout`'s layout under the same names
  (routes/support arrays under the prefixes ``routes.`` / ``support.``); the string metadata holds
  ``schema`` (``skyrl-numerics/rollout``), ``schema_version``, ``engine``, ``engine_version``,
  ``sampling`` (JSON) and ``meta`` (JSON).
- ``.jsonl``: an optional first header line ``{"schema": "skyrl-numerics/rollout", ...}`` with
  engine/sampling/meta, then one JSON object per sequence: ``prompt_ids`` (list[int]),
  ``response_ids`` (list[int]), ``logprobs`` (list[float], one per response token), optional
  ``trainer_logprobs``, ``group_id``, ``support`` (list of lists of token ids, one per response
  token).

Multi-turn trajectories (``schema_version`` 2; :mod:`skyrl_numerics.rollout.turns`): the arrays
``loss_mask`` (bool) and ``turns`` (int32), one per response token; in ``.jsonl`` the row fields
``loss_mask`` (list of JSON booleans) and ``turns`` (list[int]), in every row or in none, and
``null`` logprobs at the observation tokens. Files of ``schema_version`` 1 (single-turn) load
unchanged; ``save`` writes version 2.

Loading validates everything and raises :class:`~skyrl_numerics.errors.InputError` (one line) naming
the file and the first bad row, field and index. Strict: token ids are integers in ``[0, 2**31)``
(and ``< vocab_size`` when known); no float or bool is truncated into an id, a ``cu`` array or a
group id; every array is 1-D; ``cu`` arrays start at 0 and never decrease; ``schema`` and
``schema_version`` must match; unknown keys, fields and arrays are refused; logprobs must fit
float32. In ``.safetensors`` files the arrays have exactly the layout's dtypes (``FILE_DTYPES``).
Saving writes to a temp file and renames it, so a failure leaves no partial file.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from skyrl_numerics.atomic import atomic_file
from skyrl_numerics import replay
from skyrl_numerics.errors import InputError
from skyrl_numerics.hashing import default_algo, hasher
from skyrl_numerics.rollout.arrays import F32_MAX, I64_MAX, ID_MAX

if TYPE_CHECKING:
    from skyrl_numerics.rollout import Rollout

SCHEMA = "skyrl-numerics/rollout"
SCHEMA_VERSION = 2
READ_VERSIONS = (1, 2)         # version 1: single-turn, without loss_mask / turns

ROW_KEYS = ("prompt_ids", "response_ids", "logprobs", "trainer_logprobs", "group_id", "support",
            "loss_mask", "turns")
_V2_ONLY = ("loss_mask", "turns")
HEADER_KEYS = ("schema", "schema_version", "engine", "engine_version", "sampling", "meta", "vocab_size",
               "digest")
_JSONL_NAMES = {"prompt_tokens": "prompt_ids", "response_tokens": "response_ids",
                "rollout_logprobs": "logprobs", "group_ids": "group_id"}
FILE_DTYPES = {"prompt_tokens": np.int32, "prompt_cu": np.int64, "response_tokens": np.int32,
               "response_cu": np.int64, "rollout_logprobs": np.float32, "trainer_logprobs": np.float32,
               "group_ids": np.int64, "loss_mask": np.bool_, "turns": np.int32}


def _header_bytes(header: dict) -> bytes:
    h = {k: v for k, v in header.items() if k != "digest"}
    return json.dumps(h, sort_keys=True, separators=(",", ":")).encode()


def _arrays_digest(arrays: dict, header: dict, algo: str | None = None) -> str:
    """Digest of a .safetensors rollout: every array's name, dtype, shape and bytes, and the header."""
    algo = algo or default_algo()
    h = hasher(algo)
    h.update(_header_bytes(header))
    for k in sorted(arrays):
        a = np.ascontiguousarray(arrays[k])
        h.update(f"\n{k}|{a.dtype.str}|{a.shape}\n".encode())
        h.update(memoryview(a.reshape(-1).view(np.uint8)) if a.size else b"")
    return f"{algo}:{h.hexdigest()}"


def _text_digest(header: dict, body: bytes, algo: str | None = None) -> str:
    """Digest of a .jsonl rollout: the header (canonical JSON, without 'digest') and the row lines."""
    algo = algo or default_algo()
    h = hasher(algo)
    h.update(_header_bytes(header))
    h.update(b"\n")
    h.update(body)
    return f"{algo}:{h.hexdigest()}"


def _check_digest(stored, actual_fn) -> None:
    if not isinstance(stored, str) or ":" not in stored:
        raise InputError(f"'digest' is {stored!r}, expected '<algo>:<hex>'", field="digest")
    algo = stored.split(":", 1)[0]
    actual = actual_fn(algo)
    if actual != stored:
        raise InputError(f"content digest {actual} does not match the stored {stored}: the file changed "
                         "after it was written (remove the 'digest' key to load an edited file)", field="digest")


def packed_section(arrays: dict, prefix: str, name: str, default_field: str):
    """The ``skyrl_numerics.replay.<name>`` stored under the ``<prefix>.`` arrays of a file (None
    when it has none); its errors are named ``<prefix>.<field>`` (``default_field`` when the
    error names none)."""
    part = {k[len(prefix) + 1:]: v for k, v in arrays.items() if k.startswith(prefix + ".")}
    if not part:
        return None
    try:
        return getattr(replay, name).from_arrays(part)
    except InputError as e:
        raise InputError(e.message, row=e.row, field=f"{prefix}.{e.field or default_field}",
                         index=e.index) from None


class RolloutFiles:
    """The file half of :class:`~skyrl_numerics.rollout.Rollout`: ``save`` / ``load`` and their
    ``.safetensors`` / ``.jsonl`` readers and writers (formats in the module doc)."""

    # ---- IO -----------------------------------------------------------------------------
    def _header(self) -> dict:
        h = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "engine": self.engine,
             "engine_version": self.engine_version, "sampling": self.sampling, "meta": self.meta}
        if self.vocab_size is not None:
            h["vocab_size"] = self.vocab_size
        return h

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``.safetensors`` or ``.jsonl`` (by suffix) atomically."""
        path = Path(path)
        if path.suffix == ".safetensors":
            writer = self._write_safetensors
        elif path.suffix == ".jsonl":
            writer = self._write_jsonl
        else:
            raise InputError(f"unknown rollout file type {path.suffix!r} "
                             "(expected .safetensors or .jsonl)", source=str(path))
        with atomic_file(path) as tmp:
            writer(tmp)
        return path

    def _arrays(self) -> dict[str, np.ndarray]:
        arrays = {"prompt_tokens": self.prompt_tokens, "prompt_cu": self.prompt_cu,
                  "response_tokens": self.response_tokens, "response_cu": self.response_cu,
                  "rollout_logprobs": self.rollout_logprobs, "group_ids": self.group_ids}
        if self.trainer_logprobs is not None:
            arrays["trainer_logprobs"] = self.trainer_logprobs
        if self.loss_mask is not None:
            arrays["loss_mask"], arrays["turns"] = self.loss_mask, self.turns
        for prefix, obj in (("routes.", self.routes), ("support.", self.support), ("gates.", self.gates),
                            ("index.", self.index)):
            if obj is not None:
                for k, v in obj.to_arrays().items():
                    arrays[prefix + k] = np.ascontiguousarray(v)
        return arrays

    def _write_safetensors(self, path: Path) -> None:
        from safetensors.numpy import save_file

        h = self._header()
        arrays = self._arrays()
        meta = {k: (v if isinstance(v, str) else json.dumps(v)) for k, v in h.items()}
        meta["digest"] = _arrays_digest(arrays, meta)
        save_file(arrays, str(path), metadata=meta)

    def _write_jsonl(self, path: Path) -> None:
        if self.routes is not None:
            raise InputError("routes cannot be written to .jsonl (too large); use .safetensors",
                             field="routes")
        if self.index is not None:
            raise InputError("indexer choices cannot be written to .jsonl (too large); use "
                             ".safetensors", field="index")
        lines = []
        mask = self.loss_mask

        def values(lp, a, b):           # null at observation tokens (JSON has no NaN)
            v = lp[a:b].tolist()
            return v if mask is None else [x if m else None for x, m in zip(v, mask[a:b].tolist())]

        for i in range(len(self)):
            a, b = self.response_cu[i], self.response_cu[i + 1]
            row = {"prompt_ids": self.prompt(i).tolist(),
                   "response_ids": self.response(i).tolist(),
                   "logprobs": values(self.rollout_logprobs, a, b),
                   "group_id": int(self.group_ids[i])}
            if self.trainer_logprobs is not None:
                row["trainer_logprobs"] = values(self.trainer_logprobs, a, b)
            if mask is not None:
                row["loss_mask"] = mask[a:b].tolist()
                row["turns"] = self.turns[a:b].tolist()
            if self.support is not None:
                row["support"] = [self.support.row(int(t)).tolist() for t in range(a, b)]
            lines.append(json.dumps(row))
        body = "\n".join(lines)
        header = json.loads(json.dumps(self._header()))        # the values as they read back
        header["digest"] = _text_digest(header, body.encode())
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps(header) + "\n" + body + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike, *, vocab_size: int | None = None) -> "Rollout":
        """Read a rollout file; raise InputError naming the file and the first bad row/field/index.

        ``vocab_size``: when given (or stored in the file), every token id must be below it.
        """
        path = Path(path)
        src = str(path)
        if not path.exists():
            raise InputError("file not found", source=src)
        if not path.is_file():
            raise InputError("not a regular file", source=src)
        try:
            if path.suffix == ".safetensors":
                ro = cls._read_safetensors(path)
            elif path.suffix == ".jsonl":
                ro = cls._read_jsonl(path)
            else:
                raise InputError(f"unknown rollout file type {path.suffix!r} "
                                 "(expected .safetensors or .jsonl)")
            if vocab_size is not None:
                if ro.vocab_size is not None and ro.vocab_size != vocab_size:
                    raise InputError(f"file says vocab_size {ro.vocab_size}, caller {vocab_size}",
                                     field="vocab_size")
                d = {f: getattr(ro, f) for f in ro.__dataclass_fields__}
                d["vocab_size"] = vocab_size
                ro = cls(**d)
            return ro
        except InputError as e:
            raise (e if e.source is not None else e.with_source(src)) from None
        except OSError as e:
            raise InputError(f"cannot read ({e.strerror or e})", source=src) from None

    @staticmethod
    def _check_version(v, where: str) -> int:
        reads = " or ".join(map(str, READ_VERSIONS))
        if isinstance(v, bool) or not isinstance(v, int):
            raise InputError(f"{where} 'schema_version' is {v!r}, expected the integer {reads}",
                             field="schema_version")
        if v not in READ_VERSIONS:
            newer = " (written by a newer version of skyrl-numerics)" if v > SCHEMA_VERSION else ""
            raise InputError(f"{where} 'schema_version' is {v}, this library reads {reads}{newer}",
                             field="schema_version")
        return v

    @staticmethod
    def _check_vocab(v, where: str):
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= ID_MAX + 1:
            raise InputError(f"{where} 'vocab_size' is {v!r}, expected an integer in [1, 2**31]",
                             field="vocab_size")
        return v

    @classmethod
    def _read_safetensors(cls, path: Path) -> "Rollout":
        from safetensors import safe_open

        try:
            with safe_open(str(path), "np") as f:
                meta = f.metadata() or {}
                arrays = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # safetensors raises several types for a corrupt header
            msg = " ".join(str(e).split())[:200]
            raise InputError(f"not a readable safetensors file ({type(e).__name__}: {msg})") from None
        if meta.get("schema") != SCHEMA:
            raise InputError(f"metadata 'schema' is {meta.get('schema')!r}, expected {SCHEMA!r}",
                             field="schema")
        known_meta = set(HEADER_KEYS)
        for k in meta:
            if k not in known_meta:
                raise InputError(f"unknown metadata key {k!r}", field=k)

        def js(key, default):
            if key not in meta:
                return default
            try:
                return json.loads(meta[key])
            except (ValueError, RecursionError):
                raise InputError("metadata is not valid JSON", field=key) from None

        if "digest" in meta:
            _check_digest(meta["digest"], lambda algo: _arrays_digest(arrays, meta, algo))
        if "schema_version" not in meta:
            raise InputError("metadata 'schema_version' is missing", field="schema_version")
        sv = meta["schema_version"]
        # ASCII digits only: str.isdigit() also accepts "²" (int() refuses it) and "１"
        version = cls._check_version(int(sv) if sv.isascii() and sv.isdigit() and len(sv) < 10 else sv,
                                     "metadata")
        sampling, m = js("sampling", {}), js("meta", {})
        for key, v in (("sampling", sampling), ("meta", m)):
            if not isinstance(v, dict):
                raise InputError(f"expected a JSON object, got {type(v).__name__}", field=key)
        vocab = cls._check_vocab(js("vocab_size", None), "metadata")
        required = ["prompt_tokens", "prompt_cu", "response_tokens", "response_cu", "rollout_logprobs"]
        for k in required:
            if k not in arrays:
                raise InputError("missing array", field=k)
        for k, v in arrays.items():
            if k.startswith(("routes.", "support.", "gates.", "index.")):
                continue
            if k not in FILE_DTYPES or (version < 2 and k in _V2_ONLY):
                old = f" (not in schema_version {version})" if k in FILE_DTYPES else ""
                raise InputError(f"unknown array {k!r}{old}", field=k)
            if v.dtype != FILE_DTYPES[k] or v.ndim != 1:
                raise InputError(f"expected 1-D {np.dtype(FILE_DTYPES[k]).name}, got {v.dtype} of shape {v.shape}",
                                 field=k)
        routes, gates, index, support = (packed_section(arrays, prefix, name, default) for prefix, name, default in (
            ("routes", "PackedRoutes", "values"), ("gates", "PackedGates", "values"),
            ("index", "PackedIndex", "values"), ("support", "PackedSupport", "token_ids")))
        return cls(prompt_tokens=arrays["prompt_tokens"], prompt_cu=arrays["prompt_cu"],
                   response_tokens=arrays["response_tokens"], response_cu=arrays["response_cu"],
                   rollout_logprobs=arrays["rollout_logprobs"],
                   trainer_logprobs=arrays.get("trainer_logprobs"),
                   group_ids=arrays.get("group_ids"), routes=routes, support=support, gates=gates,
                   index=index,
                   loss_mask=arrays.get("loss_mask"), turns=arrays.get("turns"),
                   sampling=sampling, meta=m, engine=meta.get("engine", "unknown"),
                   engine_version=meta.get("engine_version", "unknown"), vocab_size=vocab)

    @staticmethod
    def _ids_field(v, row: int, key: str) -> list:
        if not isinstance(v, list):
            raise InputError(f"expected a list, got {type(v).__name__}", row=row, field=key)
        for j, t in enumerate(v):
            if not isinstance(t, int) or isinstance(t, bool):
                raise InputError(f"token id {t!r} is not an integer", row=row, field=key, index=j)
            if not 0 <= t <= ID_MAX:
                raise InputError(f"token id {t} outside [0, 2**31)", row=row, field=key, index=j)
        return v

    @staticmethod
    def _values_field(v, row: int, key: str, nulls: bool = False) -> list:
        """Numbers (``null`` too when ``nulls``: a multi-turn row's observation tokens -> NaN)."""
        if not isinstance(v, list):
            raise InputError(f"expected a list, got {type(v).__name__}", row=row, field=key)
        for j, x in enumerate(v):
            if x is None and nulls:
                continue
            if not isinstance(x, (int, float)) or isinstance(x, bool):
                raise InputError(f"value {x!r} is not a number", row=row, field=key, index=j)
            if isinstance(x, int):
                if abs(x) > F32_MAX:
                    raise InputError(f"value {x} does not fit float32", row=row, field=key, index=j)
            elif not math.isfinite(x):
                raise InputError(f"value {x!r} is not finite", row=row, field=key, index=j)
            elif abs(x) > F32_MAX:
                raise InputError(f"value {x!r} does not fit float32", row=row, field=key, index=j)
        # as floats: an integer beyond int64 (-10**30) would make the array an object array
        return [math.nan if x is None else float(x) for x in v]

    @staticmethod
    def _turn_fields(obj: dict, row: int, n: int) -> None:
        m, t = obj["loss_mask"], obj["turns"]
        for key, v in (("loss_mask", m), ("turns", t)):
            if not isinstance(v, list):
                raise InputError(f"expected a list, got {type(v).__name__}", row=row, field=key)
            if len(v) != n:
                raise InputError(f"{len(v)} values for {n} response tokens", row=row, field=key)
        for j, x in enumerate(m):
            if not isinstance(x, bool):
                raise InputError(f"value {x!r} is not a JSON boolean", row=row, field="loss_mask", index=j)
        for j, x in enumerate(t):
            if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x <= ID_MAX:
                raise InputError(f"turn index {x!r} is not an integer in [0, 2**31)", row=row, field="turns",
                                 index=j)

    @classmethod
    def _read_jsonl(cls, path: Path) -> "Rollout":
        header: dict = {}
        prompts, responses, lps, tlps, groups, supports, masks, turns = [], [], [], [], [], [], [], []
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except UnicodeDecodeError as e:
            raise InputError(f"not UTF-8 text (byte {e.start})") from None
        row = -1
        seen_row = False
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"line {lineno} is not valid JSON ({e.msg})") from None
            except (ValueError, RecursionError) as e:   # int digit limit, nesting depth
                what = "nested too deeply" if isinstance(e, RecursionError) else " ".join(str(e).split())[:120]
                raise InputError(f"line {lineno} is not valid JSON ({what})") from None
            if not isinstance(obj, dict):
                raise InputError(f"line {lineno} is not a JSON object")
            if "schema" in obj and not seen_row and not header:
                if obj["schema"] != SCHEMA:
                    raise InputError(f"header 'schema' is {obj['schema']!r}, expected {SCHEMA!r}",
                                     field="schema")
                for k in obj:
                    if k not in HEADER_KEYS:
                        raise InputError(f"unknown header key {k!r} (line {lineno})", field=k)
                if "schema_version" not in obj:
                    raise InputError("header 'schema_version' is missing", field="schema_version")
                cls._check_version(obj["schema_version"], "header")
                for k, typ in (("engine", str), ("engine_version", str), ("sampling", dict), ("meta", dict)):
                    if k in obj and not isinstance(obj[k], typ):
                        raise InputError(f"header '{k}' is {type(obj[k]).__name__}, expected {typ.__name__}",
                                         field=k)
                cls._check_vocab(obj.get("vocab_size"), "header")
                header = obj
                if "digest" in obj:
                    body = "\n".join(lines[lineno:]).rstrip("\n").encode()
                    _check_digest(obj["digest"], lambda algo: _text_digest(obj, body, algo))
                continue
            seen_row = True
            row += 1
            version = header.get("schema_version", SCHEMA_VERSION)
            for k in obj:
                if k not in ROW_KEYS or (version < 2 and k in _V2_ONLY):
                    old = f" (not in schema_version {version})" if k in ROW_KEYS else ""
                    raise InputError(f"unknown field {k!r}{old}", row=row, field=k)
            if ("loss_mask" in obj) != ("turns" in obj):
                miss = "turns" if "loss_mask" in obj else "loss_mask"
                raise InputError("missing field ('loss_mask' and 'turns' go together)", row=row, field=miss)
            for key in ("prompt_ids", "response_ids", "logprobs"):
                if key not in obj:
                    raise InputError("missing field", row=row, field=key)
            cls._ids_field(obj["prompt_ids"], row, "prompt_ids")
            cls._ids_field(obj["response_ids"], row, "response_ids")
            n = len(obj["response_ids"])
            multi = "loss_mask" in obj
            if multi:
                cls._turn_fields(obj, row, n)
            for key in ("logprobs", "trainer_logprobs"):
                if key not in obj:
                    continue
                obj[key] = cls._values_field(obj[key], row, key, nulls=multi)   # (as floats)
                if len(obj[key]) != n:
                    raise InputError(f"{len(obj[key])} values for {n} response tokens", row=row, field=key)
            g = obj.get("group_id", row)
            if isinstance(g, bool) or not isinstance(g, int) or not -I64_MAX - 1 <= g <= I64_MAX:
                raise InputError(f"group id {g!r} is not an int64 integer", row=row, field="group_id")
            sup = obj.get("support")
            if sup is not None:
                if not isinstance(sup, list):
                    raise InputError(f"expected a list of lists, got {type(sup).__name__}", row=row, field="support")
                if len(sup) != n:
                    raise InputError(f"{len(sup)} support sets for {n} response tokens", row=row, field="support")
                for j, ids in enumerate(sup):
                    try:
                        cls._ids_field(ids, row, "support")
                    except InputError as e:
                        raise InputError(f"support set {j}: {e.message}", row=row, field="support", index=j) from None
                    if not ids:
                        raise InputError("empty support set", row=row, field="support", index=j)
                    if len(set(ids)) != len(ids):
                        raise InputError("duplicate token id in a support set", row=row, field="support", index=j)
            prompts.append(obj["prompt_ids"])
            responses.append(obj["response_ids"])
            lps.append(obj["logprobs"])
            tlps.append(obj.get("trainer_logprobs"))
            groups.append(g)
            supports.append(sup)
            masks.append(obj.get("loss_mask"))
            turns.append(obj.get("turns"))
        if not prompts:
            raise InputError("no rows", field="rows")
        have_t = [t is not None for t in tlps]
        if any(have_t) and not all(have_t):
            i = have_t.index(False)
            raise InputError("'trainer_logprobs' present in some rows but not this one",
                             row=i, field="trainer_logprobs")
        have_m = [m is not None for m in masks]
        if any(have_m) and not all(have_m):
            raise InputError("'loss_mask' and 'turns' present in some rows but not this one",
                             row=have_m.index(False), field="loss_mask")
        support = None
        vocab = header.get("vocab_size")
        have_s = [s is not None for s in supports]
        if any(have_s):
            if not all(have_s):
                raise InputError("'support' present in some rows but not this one",
                                 row=have_s.index(False), field="support")
            from skyrl_numerics.replay import PackedSupport
            per_token = [s for seq in supports for s in seq]
            support = PackedSupport.from_sets(per_token, vocab)
        try:
            return cls.from_lists(prompts, responses, lps,
                                  trainer_logprobs=tlps if all(have_t) else None,
                                  group_ids=np.asarray(groups, dtype=np.int64), support=support,
                                  loss_mask=masks if all(have_m) else None,
                                  turns=turns if all(have_m) else None,
                                  sampling=header.get("sampling", {}), meta=header.get("meta", {}),
                                  engine=header.get("engine", "unknown"),
                                  engine_version=header.get("engine_version", "unknown"), vocab_size=vocab)
        except InputError as e:     # name the field as the file spells it
            f = _JSONL_NAMES.get(e.field, e.field)
            raise InputError(e.message, row=e.row, field=f, index=e.index, turn=e.turn) from None
