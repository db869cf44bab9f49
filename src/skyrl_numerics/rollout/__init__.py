"""The ``Rollout`` batch: ragged token ids and logprobs, no padding on the wire.

Layout (B sequences; ``cu`` arrays are int64 prefix sums starting at 0, length B + 1)::

    prompt_tokens      int32   [Σ prompt_len]     prompt_cu   [B+1]
    response_tokens    int32   [Σ response_len]   response_cu [B+1]
    rollout_logprobs   float32 [Σ response_len]   the engine's logprob of each sampled token
    trainer_logprobs   float32 [Σ response_len]   optional: a trainer's recomputation
    group_ids          int64   [B]                which prompt a sample came from (n > 1, GRPO)
    routes             PackedRoutes | None         R3 routes (skyrl_numerics.replay)
    support            PackedSupport | None        top-p/top-k support per response token
    gates              PackedGates | None          the engine's MoE combine weights, the routes' rows
    index              PackedIndex | None          DSA indexer choices (skyrl_numerics.replay.index)
    sampling           dict    temperature, top_p, top_k, seed, n, max_tokens, logprobs_mode
    engine, engine_version, meta
    loss_mask          bool    [Σ response_len]   optional, multi-turn: True = model token,
                                                  False = observation (environment/tool) token
    turns              int32   [Σ response_len]   optional, multi-turn: the turn of each token

Multi-turn trajectories (both arrays, or neither = single-turn): a turn is observation tokens then
one model segment; turn indices start at 0 in each row and step by 0 or 1; logprobs are NaN
exactly at the observation tokens. Rules and views: :mod:`skyrl_numerics.rollout.turns`.

File formats (``Rollout.save`` / ``Rollout.load``, ``.safetensors`` and ``.jsonl``) and loading's
checks: :mod:`skyrl_numerics.rollout.files`; strict array conversion: :mod:`skyrl_numerics.rollout.arrays`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from skyrl_numerics.errors import InputError
from skyrl_numerics.rollout.arrays import (I64_MAX, ID_MAX, cu_from_lengths, first_index, float_array, int_array,
                                           locate_row, is_monotone, non_finite, as_numpy)
from skyrl_numerics.rollout.files import (FILE_DTYPES, HEADER_KEYS, ROW_KEYS, SCHEMA,
                                          SCHEMA_VERSION, RolloutFiles)
from skyrl_numerics.rollout.turns import (bool_array, check_masked_logprobs, check_turns,
                                          num_turns, turn_starts)

# the package's public API: the batch and its file format (rollout/files.py)
__all__ = ["Rollout", "RolloutFiles", "SCHEMA", "SCHEMA_VERSION", "FILE_DTYPES", "HEADER_KEYS",
           "ROW_KEYS", "POSITIVE_LOGPROB_TOL", "check_turns", "check_masked_logprobs", "num_turns",
           "turn_starts"]

# A logprob above this is rejected as "positive" (float rounding can give tiny positive values).
POSITIVE_LOGPROB_TOL = 1e-6


@dataclass
class Rollout(RolloutFiles):
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
    vocab_size: int | None = None      # when known, every token id must be < vocab_size
    # the engine's top-K logprobs per response token (gap.topk.TopkLogprobs), when asked for
    # with generate(topk_logprobs=K); in memory only: not written by save()
    topk: Any = None
    # a digest of the engine's full logits row per response token (gap.digest.LogitsDigests),
    # when asked for with generate(logits_digest=True); in memory only: not written by save()
    logits_digest: Any = None
    # multi-turn trajectories (skyrl_numerics.rollout.turns): both or neither
    loss_mask: np.ndarray | None = None   # bool, one per response token: True = model token
    turns: np.ndarray | None = None       # int32, one per response token: its turn index
    # the engine's MoE combine weights (skyrl_numerics.replay.PackedGates), rows as ``routes``
    gates: Any = None
    # the DSA indexer's key positions per token and layer (skyrl_numerics.replay.PackedIndex)
    index: Any = None

    def __post_init__(self):
        self.prompt_cu = int_array(self.prompt_cu, "prompt_cu", 0, I64_MAX, np.int64)
        self.response_cu = int_array(self.response_cu, "response_cu", 0, I64_MAX, np.int64)
        for name, cu in (("prompt_tokens", self.prompt_cu), ("response_tokens", self.response_cu)):
            try:
                setattr(self, name, int_array(getattr(self, name), name, 0, ID_MAX, np.int32))
            except InputError as e:
                if e.index is not None and is_monotone(cu) and e.index < cu[-1]:
                    row, j = locate_row(cu, e.index)
                    raise InputError(e.message, row=row, field=name, index=j) from None
                raise
        for name in ("rollout_logprobs", "trainer_logprobs"):
            if getattr(self, name) is not None:
                try:
                    setattr(self, name, float_array(getattr(self, name), name))
                except InputError as e:
                    if e.index is not None and is_monotone(self.response_cu) and e.index < self.response_cu[-1]:
                        row, j = locate_row(self.response_cu, e.index)
                        raise InputError(e.message, row=row, field=name, index=j) from None
                    raise
        for name, conv in (("loss_mask", lambda x: bool_array(x, "loss_mask")),
                           ("turns", lambda x: int_array(x, "turns", 0, ID_MAX, np.int32))):
            if getattr(self, name) is not None:
                try:
                    setattr(self, name, conv(getattr(self, name)))
                except InputError as e:
                    if e.index is not None and is_monotone(self.response_cu) and e.index < self.response_cu[-1]:
                        row, j = locate_row(self.response_cu, e.index)
                        raise InputError(e.message, row=row, field=name, index=j) from None
                    raise
        if self.group_ids is None:
            self.group_ids = np.arange(max(len(self.prompt_cu) - 1, 0), dtype=np.int64)
        try:
            self.group_ids = int_array(self.group_ids, "group_ids", -I64_MAX - 1, I64_MAX, np.int64)
        except InputError as e:
            raise InputError(e.message, row=e.index, field="group_ids") from None
        if self.vocab_size is not None:
            v = self.vocab_size
            if isinstance(v, (bool, float)) or not isinstance(v, (int, np.integer)) or not 1 <= int(v) <= ID_MAX + 1:
                raise InputError(f"vocab_size {v!r} is not an integer in [1, 2**31]", field="vocab_size")
            self.vocab_size = int(v)
        self.validate()

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_lists(cls, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                   logprobs: Sequence[Sequence[float]], *, trainer_logprobs=None, loss_mask=None,
                   turns=None, **kw) -> "Rollout":
        """Build from one list per sequence (the natural shape of engine outputs).

        Multi-turn: ``loss_mask`` and ``turns``, one list per sequence with one entry per response
        token; logprobs at observation tokens are NaN or ``None``."""
        if not (len(prompts) == len(responses) == len(logprobs)):
            raise InputError(f"got {len(prompts)} prompts, {len(responses)} responses and "
                             f"{len(logprobs)} logprob rows; they must match", field="rows")
        for i, (r, lp) in enumerate(zip(responses, logprobs)):
            if len(r) != len(lp):
                raise InputError(f"{len(lp)} logprobs for {len(r)} response tokens",
                                 row=i, field="logprobs")
        def nan_for_none(rows):
            return [[math.nan if x is None else x for x in r] if isinstance(r, (list, tuple)) else r
                    for r in rows]

        def cat(seqs, name):
            # no dtype forced: floats / bools / strings stay what they are and are refused by
            # the constructor instead of being truncated into integers
            try:
                for i, s in enumerate(seqs):
                    if isinstance(s, (list, tuple)):
                        for j, x in enumerate(s):
                            if (type(x) is bool or isinstance(x, np.bool_)) and name != "loss_mask":
                                raise InputError(f"value {x!r} is a bool", row=i, field=name, index=j)
                parts = [np.asarray(s) for s in seqs]
                for i, a in enumerate(parts):
                    if a.ndim != 1:
                        raise InputError(f"expected a flat list, got shape {a.shape}", row=i, field=name)
                parts = [a for a in parts if a.size]
                return np.concatenate(parts) if parts else np.zeros(0, np.int64)
            except (ValueError, TypeError) as e:
                raise InputError(f"not a list of numbers ({' '.join(str(e).split())[:120]})", field=name) from None

        tl = None
        if trainer_logprobs is not None:
            if len(trainer_logprobs) != len(responses):
                raise InputError(f"{len(trainer_logprobs)} trainer logprob rows for {len(responses)} responses",
                                 field="trainer_logprobs")
            for i, (r, lp) in enumerate(zip(responses, trainer_logprobs)):
                if len(r) != len(lp):
                    raise InputError(f"{len(lp)} trainer logprobs for {len(r)} response tokens",
                                     row=i, field="trainer_logprobs")
            tl = cat(nan_for_none(trainer_logprobs), "trainer_logprobs")
        per_token = {}
        for name, rows in (("loss_mask", loss_mask), ("turns", turns)):
            if rows is None:
                continue
            if len(rows) != len(responses):
                raise InputError(f"{len(rows)} {name} rows for {len(responses)} responses", field=name)
            for i, (r, x) in enumerate(zip(responses, rows)):
                if len(r) != len(x):
                    raise InputError(f"{len(x)} {name} values for {len(r)} response tokens", row=i, field=name)
            per_token[name] = cat(rows, name)
        return cls(prompt_tokens=cat(prompts, "prompt_tokens"), prompt_cu=cu_from_lengths(map(len, prompts)),
                   response_tokens=cat(responses, "response_tokens"), response_cu=cu_from_lengths(map(len, responses)),
                   rollout_logprobs=cat(nan_for_none(logprobs), "rollout_logprobs"), trainer_logprobs=tl,
                   **per_token, **kw)

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
        """A copy sharing all arrays, with ``trainer_logprobs`` set (flat, one per response token;
        in a multi-turn rollout the values at observation tokens are replaced by NaN: a trainer
        scores the whole stream, but only model tokens have logprobs here)."""
        d = {f: getattr(self, f) for f in self.__dataclass_fields__}
        tl = as_numpy(trainer_logprobs).reshape(-1)
        if self.loss_mask is not None and tl.shape == self.loss_mask.shape:
            tl = np.where(self.loss_mask, float_array(tl, "trainer_logprobs"), np.float32(np.nan))
        d["trainer_logprobs"] = tl
        return Rollout(**d)

    # ---- multi-turn views (skyrl_numerics.rollout.turns) ---------------------------------
    @property
    def is_multi_turn(self) -> bool:
        """Whether the rollout carries ``loss_mask`` / ``turns`` (even if every row has one turn)."""
        return self.loss_mask is not None

    @property
    def model_mask(self) -> np.ndarray:
        """bool [Σ response_len]: True on model tokens (all True for a single-turn rollout)."""
        return self.loss_mask if self.loss_mask is not None else np.ones(self.num_response_tokens, bool)

    @property
    def turn_index(self) -> np.ndarray:
        """int32 [Σ response_len]: each token's turn (all 0 for a single-turn rollout)."""
        return self.turns if self.turns is not None else np.zeros(self.num_response_tokens, np.int32)

    @property
    def num_turns(self) -> np.ndarray:
        """int64 [B]: turns per row (0 for an empty response)."""
        return num_turns(self.response_cu, self.turns)

    def turn_starts(self, i: int) -> np.ndarray:
        """Offsets within row ``i``'s response of each turn's model segment (its first model token)."""
        return turn_starts(self.response_cu, self.loss_mask, self.turns, i)

    # ---- validation ---------------------------------------------------------------------
    def validate(self, source: str | None = None) -> None:
        """Check shapes, prefix sums, dtypes and values; raise InputError at the first problem."""
        def err(msg, **kw):
            return InputError(msg, source=source, **kw)

        for name, dt in (("prompt_cu", np.int64), ("response_cu", np.int64), ("prompt_tokens", np.int32),
                         ("response_tokens", np.int32), ("group_ids", np.int64)):
            a = getattr(self, name)
            if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype != dt:
                raise err(f"expected a 1-D {np.dtype(dt).name} array, got "
                          f"{getattr(a, 'dtype', type(a).__name__)} of shape {getattr(a, 'shape', None)}", field=name)
        for name in ("prompt_cu", "response_cu"):
            cu = getattr(self, name)
            if len(cu) < 1 or cu[0] != 0:
                raise err("must be a 1-D prefix sum starting at 0", field=name, index=0)
            bad = np.flatnonzero(np.diff(cu) < 0)
            if len(bad):
                raise err(f"decreases at index {bad[0] + 1} ({cu[bad[0]]} -> {cu[bad[0] + 1]})",
                          field=name, row=int(bad[0]), index=int(bad[0]) + 1)
        b = len(self.prompt_cu) - 1
        if b == 0:
            raise err("empty rollout (no sequences)", field="rows")
        if len(self.response_cu) - 1 != b:
            raise err(f"{len(self.response_cu) - 1} responses for {b} prompts", field="response_cu")
        if self.prompt_cu[-1] != len(self.prompt_tokens):
            raise err(f"prompt_cu ends at {self.prompt_cu[-1]} but there are "
                      f"{len(self.prompt_tokens)} prompt tokens", field="prompt_cu", index=b)
        n = int(self.response_cu[-1])
        if n != len(self.response_tokens):
            raise err(f"response_cu ends at {n} but there are {len(self.response_tokens)} "
                      "response tokens", field="response_cu", index=b)
        empty_prompt = np.flatnonzero(np.diff(self.prompt_cu) == 0)
        if len(empty_prompt):
            raise err("empty prompt", row=int(empty_prompt[0]), field="prompt_ids")
        self._validate_turns(n, err)
        for name in ("rollout_logprobs", "trainer_logprobs"):
            lp = getattr(self, name)
            if lp is None:
                continue
            if not isinstance(lp, np.ndarray) or lp.dtype != np.float32 or lp.shape != (n,):
                raise err(f"expected {n} float32 values (one per response token), got "
                          f"{getattr(lp, 'dtype', type(lp).__name__)} of shape {getattr(lp, 'shape', None)}",
                          field=name)
            check_masked_logprobs(lp, self.response_cu, self.loss_mask, self.turns, name,
                                  POSITIVE_LOGPROB_TOL, err)
        V = self.vocab_size
        if V is not None and self.support is not None and getattr(self.support, "vocab_size", None) not in (None, V):
            raise err(f"support vocab_size {self.support.vocab_size} != rollout vocab_size {V}", field="vocab_size")
        if V is None and self.support is not None:
            V = getattr(self.support, "vocab_size", None)
        for name in ("prompt_tokens", "response_tokens"):
            t = getattr(self, name)
            cu = self.prompt_cu if name == "prompt_tokens" else self.response_cu
            if len(t) and t.min() < 0:
                row, j = locate_row(cu, first_index(t < 0))
                raise err(f"negative token id {int(t[cu[row] + j])}", row=row, field=name, index=j)
            if V is not None and len(t) and int(t.max()) >= V:
                row, j = locate_row(cu, first_index(t >= V))
                raise err(f"token id {int(t[cu[row] + j])} >= vocab_size {V}", row=row, field=name, index=j)
        if self.group_ids.shape != (b,):
            raise err(f"expected {b} group ids, got shape {self.group_ids.shape}", field="group_ids")
        for name, typ in (("engine", str), ("engine_version", str), ("sampling", dict), ("meta", dict)):
            if not isinstance(getattr(self, name), typ):
                raise err(f"expected {typ.__name__}, got {type(getattr(self, name)).__name__}", field=name)
        for name in ("sampling", "meta"):       # JSON has no NaN / Infinity (a report would not parse)
            where = non_finite(getattr(self, name))
            if where is not None:
                raise err(f"{name}{where} is not a finite number", field=name)
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
        if self.gates is not None:
            if self.routes is None:
                raise err("gate weights without routes", field="gates")
            self.gates.check_routes(self.routes)
        if self.index is not None:
            try:
                self.index.check_rollout(self.prompt_lens + self.response_lens)
            except InputError as e:
                raise err(e.message, row=e.row, field="index") from None
        if self.support is not None:
            ns = int(self.support.num_tokens)
            if ns != n:
                raise err(f"support sets for {ns} tokens; there are {n} response tokens",
                          field="support")

    def _validate_turns(self, n: int, err) -> None:
        m, t = self.loss_mask, self.turns
        if (m is None) != (t is None):
            have, miss = ("loss_mask", "turns") if t is None else ("turns", "loss_mask")
            raise err(f"'{have}' without '{miss}': a multi-turn rollout carries both", field=miss)
        if m is None:
            return
        for name, dt in (("loss_mask", np.bool_), ("turns", np.int32)):
            a = getattr(self, name)
            if not isinstance(a, np.ndarray) or a.dtype != dt or a.shape != (n,):
                raise err(f"expected {n} {np.dtype(dt).name} values (one per response token), got "
                          f"{getattr(a, 'dtype', type(a).__name__)} of shape {getattr(a, 'shape', None)}",
                          field=name)
        check_turns(self.response_cu, m, t, err)
