"""The ``Rollout`` batch: ragged token ids and logprobs, no padding on the wire.

Layout (B sequences; ``cu`` arrays are int64 prefix sums starting at 0, length B + 1)::

    prompt_tokens      int32   [Σ prompt_len]     prompt_cu   [B+1]
    response_tokens    int32   [Σ response_len]   response_cu [B+1]
    rollout_logprobs   float32 [Σ response_len]   the engine's logprob of each sampled token
    trainer_logprobs   float32 [Σ response_len]   optional: a trainer's recomputation
    group_ids          int64   [B]                which prompt a sample came from (n > 1, GRPO)
    routes             PackedRoutes | None         R3 routes (skyrl_numerics.replay)
    support            PackedSupport | None        top-p/top-k support per response token
    sampling           dict    temperature, top_p, top_k, seed, n, max_tokens, logprobs_mode
    engine, engine_version, meta

File formats (see README "File formats"):

- ``.safetensors``: the arrays above under the same names (routes/support arrays under the
  prefixes ``routes.`` / ``support.``); the string metadata holds ``schema``
  (``skyrl-numerics/rollout``), ``schema_version``, ``engine``, ``engine_version``, ``sampling``
  (JSON) and ``meta`` (JSON).
- ``.jsonl``: an optional first header line ``{"schema": "skyrl-numerics/rollout", ...}`` with
  engine/sampling/meta, then one JSON object per sequence: ``prompt_ids`` (list[int]),
  ``response_ids`` (list[int]), ``logprobs`` (list[float], one per response token), optional
  ``trainer_logprobs``, ``group_id``, ``support`` (list of lists of token ids, one per response
  token).

Loading validates everything and raises :class:`~skyrl_numerics.errors.InputError` naming the first
bad row and field. Saving writes to a temp file and renames it, so a failure leaves no partial file.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from .atomic import atomic_file
from .errors import InputError

SCHEMA = "skyrl-numerics/rollout"
SCHEMA_VERSION = 1
# A logprob above this is rejected as "positive" (float rounding can give tiny positive values).
POSITIVE_LOGPROB_TOL = 1e-6


def _cu(lengths: Iterable[int]) -> np.ndarray:
    lengths = np.asarray(list(lengths), dtype=np.int64)
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


@dataclass
class Rollout:
    prompt_tokens: np.ndarray
    prompt_cu: np.ndarray
    response_tokens: np.ndarray
    response_cu: np.ndarray
    rollout_logprobs: np.ndarray
    trainer_logprobs: np.ndarray | None = None
    group_ids: np.ndarray | None = None
    routes: Any = None
    support: Any = None
    sampling: dict = field(default_factory=dict)
    engine: str = "unknown"
    engine_version: str = "unknown"
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        self.prompt_tokens = np.ascontiguousarray(self.prompt_tokens, dtype=np.int32)
        self.response_tokens = np.ascontiguousarray(self.response_tokens, dtype=np.int32)
        self.prompt_cu = np.ascontiguousarray(self.prompt_cu, dtype=np.int64)
        self.response_cu = np.ascontiguousarray(self.response_cu, dtype=np.int64)
        self.rollout_logprobs = np.ascontiguousarray(self.rollout_logprobs, dtype=np.float32)
        if self.trainer_logprobs is not None:
            self.trainer_logprobs = np.ascontiguousarray(self.trainer_logprobs, dtype=np.float32)
        if self.group_ids is None:
            self.group_ids = np.arange(len(self.prompt_cu) - 1, dtype=np.int64)
        self.group_ids = np.ascontiguousarray(self.group_ids, dtype=np.int64)
        self.validate()

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_lists(cls, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                   logprobs: Sequence[Sequence[float]], *, trainer_logprobs=None, **kw) -> "Rollout":
        """Build from one list per sequence (the natural shape of engine outputs)."""
        if not (len(prompts) == len(responses) == len(logprobs)):
            raise InputError(f"got {len(prompts)} prompts, {len(responses)} responses and "
                             f"{len(logprobs)} logprob rows; they must match", field="rows")
        for i, (r, lp) in enumerate(zip(responses, logprobs)):
            if len(r) != len(lp):
                raise InputError(f"{len(lp)} logprobs for {len(r)} response tokens",
                                 row=i, field="logprobs")
        cat = lambda seqs, dt: (np.concatenate([np.asarray(s, dtype=dt) for s in seqs])
                                if len(seqs) and sum(len(s) for s in seqs) else np.zeros(0, dt))
        tl = None
        if trainer_logprobs is not None:
            for i, (r, lp) in enumerate(zip(responses, trainer_logprobs)):
                if len(r) != len(lp):
                    raise InputError(f"{len(lp)} trainer logprobs for {len(r)} response tokens",
                                     row=i, field="trainer_logprobs")
            tl = cat(trainer_logprobs, np.float32)
        return cls(prompt_tokens=cat(prompts, np.int64), prompt_cu=_cu(map(len, prompts)),
                   response_tokens=cat(responses, np.int64), response_cu=_cu(map(len, responses)),
                   rollout_logprobs=cat(logprobs, np.float64), trainer_logprobs=tl, **kw)

    # ---- views --------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.prompt_cu) - 1

    @property
    def prompt_lens(self) -> np.ndarray:
        return np.diff(self.prompt_cu)

    @property
    def response_lens(self) -> np.ndarray:
        return np.diff(self.response_cu)

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_cu[-1])

    def prompt(self, i: int) -> np.ndarray:
        return self.prompt_tokens[self.prompt_cu[i]:self.prompt_cu[i + 1]]

    def response(self, i: int) -> np.ndarray:
        return self.response_tokens[self.response_cu[i]:self.response_cu[i + 1]]

    def logprobs(self, i: int) -> np.ndarray:
        return self.rollout_logprobs[self.response_cu[i]:self.response_cu[i + 1]]

    def with_trainer_logprobs(self, trainer_logprobs) -> "Rollout":
        """A copy sharing all arrays, with ``trainer_logprobs`` set (flat, one per response token)."""
        d = {f: getattr(self, f) for f in self.__dataclass_fields__}
        d["trainer_logprobs"] = np.asarray(trainer_logprobs, dtype=np.float32).reshape(-1)
        return Rollout(**d)

    # ---- validation ---------------------------------------------------------------------
    def validate(self, source: str | None = None) -> None:
        """Check shapes, prefix sums, dtypes and values; raise InputError at the first problem."""
        def err(msg, **kw):
            return InputError(msg, source=source, **kw)

        for name in ("prompt_cu", "response_cu"):
            cu = getattr(self, name)
            if cu.ndim != 1 or len(cu) < 1 or cu[0] != 0:
                raise err("must be a 1-D prefix sum starting at 0", field=name)
            bad = np.flatnonzero(np.diff(cu) < 0)
            if len(bad):
                raise err(f"decreases at index {bad[0] + 1} ({cu[bad[0]]} -> {cu[bad[0] + 1]})",
                          field=name, row=int(bad[0]))
        b = len(self.prompt_cu) - 1
        if b == 0:
            raise err("empty rollout (no sequences)", field="rows")
        if len(self.response_cu) - 1 != b:
            raise err(f"{len(self.response_cu) - 1} responses for {b} prompts", field="response_cu")
        if self.prompt_cu[-1] != len(self.prompt_tokens):
            raise err(f"prompt_cu ends at {self.prompt_cu[-1]} but there are "
                      f"{len(self.prompt_tokens)} prompt tokens", field="prompt_cu")
        n = int(self.response_cu[-1])
        if n != len(self.response_tokens):
            raise err(f"response_cu ends at {n} but there are {len(self.response_tokens)} "
                      "response tokens", field="response_cu")
        empty_prompt = np.flatnonzero(np.diff(self.prompt_cu) == 0)
        if len(empty_prompt):
            raise err("empty prompt", row=int(empty_prompt[0]), field="prompt_ids")
        for name in ("rollout_logprobs", "trainer_logprobs"):
            lp = getattr(self, name)
            if lp is None:
                continue
            if lp.shape != (n,):
                raise err(f"expected {n} values (one per response token), got shape {lp.shape}",
                          field=name)
            self._check_logprob_values(lp, name, err)
        for name in ("prompt_tokens", "response_tokens"):
            t = getattr(self, name)
            if len(t) and t.min() < 0:
                i = int(np.flatnonzero(t < 0)[0])
                cu = self.prompt_cu if name == "prompt_tokens" else self.response_cu
                row = int(np.searchsorted(cu, i, side="right") - 1)
                raise err(f"negative token id {int(t[i])}", row=row, field=name,
                          index=int(i - cu[row]))
        if self.group_ids.shape != (b,):
            raise err(f"expected {b} group ids, got shape {self.group_ids.shape}", field="group_ids")
        if self.routes is not None:
            seq = np.asarray(self.routes.seq_lens)
            total = self.prompt_lens + self.response_lens
            if len(seq) != b:
                raise err(f"routes hold {len(seq)} sequences for {b} in the rollout", field="routes")
            ok = (seq == total) | (seq == total - 1)
            if not ok.all():
                i = int(np.flatnonzero(~ok)[0])
                raise err(f"routes cover {int(seq[i])} tokens; prompt+response is {int(total[i])}",
                          row=i, field="routes")
        if self.support is not None:
            ns = int(self.support.num_tokens)
            if ns != n:
                raise err(f"support sets for {ns} tokens; there are {n} response tokens",
                          field="support")

    def _check_logprob_values(self, lp: np.ndarray, name: str, err) -> None:
        bad = ~np.isfinite(lp)
        kind = "not finite"
        if not bad.any():
            bad = lp > POSITIVE_LOGPROB_TOL
            kind = "positive (a logprob must be <= 0)"
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            row = int(np.searchsorted(self.response_cu, i, side="right") - 1)
            raise err(f"value {lp[i]!r} is {kind}", row=row, field=name,
                      index=int(i - self.response_cu[row]))

    # ---- IO -----------------------------------------------------------------------------
    def _header(self) -> dict:
        return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "engine": self.engine,
                "engine_version": self.engine_version, "sampling": self.sampling, "meta": self.meta}

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
        for prefix, obj in (("routes.", self.routes), ("support.", self.support)):
            if obj is not None:
                for k, v in obj.to_arrays().items():
                    arrays[prefix + k] = np.ascontiguousarray(v)
        return arrays

    def _write_safetensors(self, path: Path) -> None:
        from safetensors.numpy import save_file

        h = self._header()
        meta = {k: (v if isinstance(v, str) else json.dumps(v)) for k, v in h.items()}
        save_file(self._arrays(), str(path), metadata=meta)

    def _write_jsonl(self, path: Path) -> None:
        if self.routes is not None:
            raise InputError("routes cannot be written to .jsonl (too large); use .safetensors",
                             field="routes")
        with open(path, "w") as f:
            f.write(json.dumps(self._header()) + "\n")
            for i in range(len(self)):
                row = {"prompt_ids": self.prompt(i).tolist(),
                       "response_ids": self.response(i).tolist(),
                       "logprobs": self.logprobs(i).tolist(),
                       "group_id": int(self.group_ids[i])}
                a, b = self.response_cu[i], self.response_cu[i + 1]
                if self.trainer_logprobs is not None:
                    row["trainer_logprobs"] = self.trainer_logprobs[a:b].tolist()
                if self.support is not None:
                    row["support"] = [self.support.row(int(t)).tolist() for t in range(a, b)]
                f.write(json.dumps(row) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Rollout":
        """Read a rollout file; raise InputError naming the first bad row/field."""
        path = Path(path)
        if not path.exists():
            raise InputError("file not found", source=str(path))
        if path.suffix == ".safetensors":
            return cls._read_safetensors(path)
        if path.suffix == ".jsonl":
            return cls._read_jsonl(path)
        raise InputError(f"unknown rollout file type {path.suffix!r} "
                         "(expected .safetensors or .jsonl)", source=str(path))

    @classmethod
    def _read_safetensors(cls, path: Path) -> "Rollout":
        from safetensors import safe_open

        try:
            with safe_open(str(path), "np") as f:
                meta = f.metadata() or {}
                arrays = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # safetensors raises several types for a corrupt header
            raise InputError(f"not a readable safetensors file ({e})", source=str(path)) from None
        if meta.get("schema") != SCHEMA:
            raise InputError(f"metadata 'schema' is {meta.get('schema')!r}, expected {SCHEMA!r}",
                             source=str(path), field="schema")
        required = ["prompt_tokens", "prompt_cu", "response_tokens", "response_cu",
                    "rollout_logprobs"]
        for k in required:
            if k not in arrays:
                raise InputError("missing array", source=str(path), field=k)

        def js(key, default):
            try:
                return json.loads(meta[key]) if key in meta else default
            except json.JSONDecodeError:
                raise InputError("metadata is not valid JSON", source=str(path), field=key) from None

        routes = support = None
        route_arrays = {k[len("routes."):]: v for k, v in arrays.items() if k.startswith("routes.")}
        support_arrays = {k[len("support."):]: v for k, v in arrays.items()
                          if k.startswith("support.")}
        if route_arrays:
            from skyrl_numerics.replay import PackedRoutes
            routes = PackedRoutes.from_arrays(route_arrays)
        if support_arrays:
            from skyrl_numerics.replay import PackedSupport
            support = PackedSupport.from_arrays(support_arrays)
        try:
            return cls(prompt_tokens=arrays["prompt_tokens"], prompt_cu=arrays["prompt_cu"],
                       response_tokens=arrays["response_tokens"], response_cu=arrays["response_cu"],
                       rollout_logprobs=arrays["rollout_logprobs"],
                       trainer_logprobs=arrays.get("trainer_logprobs"),
                       group_ids=arrays.get("group_ids"), routes=routes, support=support,
                       sampling=js("sampling", {}), meta=js("meta", {}),
                       engine=meta.get("engine", "unknown"),
                       engine_version=meta.get("engine_version", "unknown"))
        except InputError as e:
            raise e.with_source(str(path)) from None

    @classmethod
    def _read_jsonl(cls, path: Path) -> "Rollout":
        header: dict = {}
        prompts, responses, lps, tlps, groups, supports = [], [], [], [], [], []
        src = str(path)
        with open(path) as f:
            lines = [ln for ln in f.read().splitlines()]
        row = -1
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"line {lineno} is not valid JSON ({e.msg})", source=src) from None
            if not isinstance(obj, dict):
                raise InputError(f"line {lineno} is not a JSON object", source=src)
            if "schema" in obj and row == -1 and not prompts:
                if obj["schema"] != SCHEMA:
                    raise InputError(f"header 'schema' is {obj['schema']!r}, expected {SCHEMA!r}",
                                     source=src, field="schema")
                header = obj
                continue
            row += 1
            for key in ("prompt_ids", "response_ids", "logprobs"):
                if key not in obj:
                    raise InputError("missing field", source=src, row=row, field=key)
                if not isinstance(obj[key], list):
                    raise InputError(f"expected a list, got {type(obj[key]).__name__}",
                                     source=src, row=row, field=key)
            for key in ("prompt_ids", "response_ids"):
                for j, t in enumerate(obj[key]):
                    if not isinstance(t, int) or isinstance(t, bool):
                        raise InputError(f"token id {t!r} is not an integer", source=src,
                                         row=row, field=key, index=j)
            for key in ("logprobs", "trainer_logprobs"):
                if key not in obj:
                    continue
                for j, v in enumerate(obj[key]):
                    if not isinstance(v, (int, float)) or isinstance(v, bool):
                        raise InputError(f"value {v!r} is not a number", source=src, row=row,
                                         field=key, index=j)
                    if not math.isfinite(v):
                        raise InputError(f"value {v!r} is not finite", source=src, row=row,
                                         field=key, index=j)
                if len(obj[key]) != len(obj["response_ids"]):
                    raise InputError(f"{len(obj[key])} values for {len(obj['response_ids'])} "
                                     "response tokens", source=src, row=row, field=key)
            prompts.append(obj["prompt_ids"])
            responses.append(obj["response_ids"])
            lps.append(obj["logprobs"])
            tlps.append(obj.get("trainer_logprobs"))
            groups.append(obj.get("group_id", row))
            supports.append(obj.get("support"))
        if not prompts:
            raise InputError("no rows", source=src, field="rows")
        have_t = [t is not None for t in tlps]
        if any(have_t) and not all(have_t):
            i = have_t.index(False)
            raise InputError("'trainer_logprobs' present in some rows but not this one",
                             source=src, row=i, field="trainer_logprobs")
        support = None
        have_s = [s is not None for s in supports]
        if any(have_s):
            if not all(have_s):
                raise InputError("'support' present in some rows but not this one", source=src,
                                 row=have_s.index(False), field="support")
            from skyrl_numerics.replay import PackedSupport
            per_token = [s for seq in supports for s in seq]
            support = PackedSupport.from_sets(per_token)
        try:
            return cls.from_lists(prompts, responses, lps,
                                  trainer_logprobs=tlps if all(have_t) else None,
                                  group_ids=np.asarray(groups, dtype=np.int64), support=support,
                                  sampling=header.get("sampling", {}), meta=header.get("meta", {}),
                                  engine=header.get("engine", "unknown"),
                                  engine_version=header.get("engine_version", "unknown"))
        except InputError as e:
            raise e.with_source(src) from None
