"""SkyRL 0.4's wire formats for R3 routes and sampled supports (its ``/skyrl/v1/generate``), to and from
our types. SkyRL's own code (``skyrl/backends/skyrl_train/inference_servers/generate_wire.py``,
``utils/routed_experts.py``, ``utils/sample_support.py``) is the spec; ``tests/integrations/test_skyrl_wire.py``
checks these functions against it.

Envelope: one array as ``{"data": base64(C-order bytes), "shape": [...], "dtype": numpy name}``, ``data``
first (SkyRL's client splices the base64 out of the raw body by scanning for ``"<field>":{"data":"``).

Routes (field ``routed_experts``): ``[positions, layers, k]`` as vLLM's engine returns them (every hidden
layer, dense layers 0; positions ``routed_experts_prompt_start .. prompt + response - 2``), in the
*canonical* dtype of the largest id present (SkyRL's ``compact_routed_expert_indices``)::

    max id < 2**8  -> uint8,   < 2**15 -> int16,   < 2**31 -> int32

SkyRL's decoder refuses any other dtype for the same values (vLLM's uint16 for > 256 experts included)
and refuses vLLM's base64 ``.npy`` string. SkyRL's ``RoutedExpertTrace`` concatenates the per-call arrays
of a multi-turn trajectory; :meth:`PackedRoutes.from_vllm` / :func:`decode_vllm_routes` read those arrays
as they are (any integer dtype).

Supports (field ``rollout_sample_support``): ``[tokens, K]`` int32, row ``t`` the ids the sampler kept for
response token ``t`` in **rank order** (highest processed logprob first), then ``-1`` padding (trailing
only). SkyRL's own server sets ``K = top_k`` and reads only ``top_k`` logprobs, cutting off ids tied with
the k-th logit, which vLLM's top-k keeps; our server sends every kept id with a ``K`` fixed per ``top_k``
(``engine/skyrl_route.py``; SkyRL's multi-turn trace refuses a width that changes between calls).
:func:`support_from_skyrl` reads such an array back as a :class:`PackedSupport` (ids sorted per row).
"""
from __future__ import annotations

import base64
import binascii
import math
from typing import Mapping, Sequence

import numpy as np

from skyrl_numerics.errors import InputError

from .support import PackedSupport

ROUTES_FIELD = "routed_experts"
SUPPORT_FIELD = "rollout_sample_support"
SUPPORT_PADDING = -1
ROUTE_DTYPES = (np.dtype(np.uint8), np.dtype(np.int16), np.dtype(np.int32))
SUPPORT_DTYPES = (np.dtype(np.int32),)


def canonical_route_dtype(max_id: int) -> np.dtype:
    """SkyRL's route dtype for ids ``0 .. max_id`` (module doc)."""
    for dt, bound in zip(ROUTE_DTYPES, (1 << 8, 1 << 15, 1 << 31)):
        if max_id < bound:
            return dt
    raise InputError(f"expert id {max_id} exceeds int32", field=ROUTES_FIELD)


def routes_to_skyrl(routes: np.ndarray) -> np.ndarray:
    """``[positions, layers, k]`` expert ids (any integer dtype, ids >= 0) in SkyRL's canonical dtype."""
    a = np.asarray(routes)
    if a.ndim != 3 or a.dtype.kind not in "iu":
        raise InputError(f"expected integer [positions, layers, k], got {a.dtype} {a.shape}", field=ROUTES_FIELD)
    if a.size and int(a.min()) < 0:
        raise InputError(f"negative expert id {int(a.min())}", field=ROUTES_FIELD)
    return np.ascontiguousarray(a, dtype=canonical_route_dtype(int(a.max(initial=0))))


def support_array(rows: Sequence[Sequence[int]], width: int | None = None) -> np.ndarray:
    """SkyRL's ``[tokens, K]`` int32 support: row ``t`` = ``rows[t]`` in the given (rank) order, padded with
    ``-1`` to ``K = width`` (default: the longest row; a longer row is refused). Ids must be >= 0 and
    distinct within a row."""
    K = max([len(r) for r in rows], default=0) if width is None else int(width)
    out = np.full((len(rows), K), SUPPORT_PADDING, dtype=np.int32)
    for t, r in enumerate(rows):
        ids = np.asarray(r, dtype=np.int64)
        if ids.size > K:
            raise InputError(f"row {t} holds {ids.size} ids, more than the width {K}", field=SUPPORT_FIELD,
                             index=t)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= 1 << 31):
            raise InputError(f"token id outside [0, 2**31) in row {t}", field=SUPPORT_FIELD, index=t)
        if np.unique(ids).size != ids.size:
            raise InputError(f"duplicate token id in row {t}", field=SUPPORT_FIELD, index=t)
        out[t, : ids.size] = ids
    return out


def support_from_skyrl(arr: np.ndarray, vocab_size: int | None = None) -> PackedSupport:
    """SkyRL's ``[tokens, K]`` support (``-1`` trailing padding) as a :class:`PackedSupport` (ids sorted
    per row). Refused with InputError naming the row: padding before an id, an empty row, an id outside
    ``[0, vocab_size)``, a duplicate."""
    a = np.asarray(arr)
    if a.ndim != 2 or a.dtype.kind not in "iu":
        raise InputError(f"expected integer [tokens, K], got {a.dtype} {a.shape}", field=SUPPORT_FIELD)
    a = a.astype(np.int64)
    valid = a >= 0
    if (a < SUPPORT_PADDING).any():
        t = int(np.argmax((a < SUPPORT_PADDING).any(axis=1)))
        raise InputError(f"row {t}: ids must be >= 0 or the padding -1", field=SUPPORT_FIELD, index=t)
    late = (~valid[:, :-1] & valid[:, 1:]).any(axis=1) if a.shape[1] > 1 else np.zeros(len(a), bool)
    if late.any():
        t = int(np.argmax(late))
        raise InputError(f"row {t}: -1 padding before a token id (padding must trail)", field=SUPPORT_FIELD,
                         index=t)
    sizes = valid.sum(axis=1)
    if (sizes == 0).any():
        t = int(np.argmin(sizes))
        raise InputError(f"row {t}: empty support", field=SUPPORT_FIELD, index=t)
    rows = np.sort(np.where(valid, a, np.iinfo(np.int64).max), axis=1)
    dup = (rows[:, 1:] == rows[:, :-1]) & valid[:, 1:]
    if dup.any():
        t = int(np.argmax(dup.any(axis=1)))
        raise InputError(f"row {t}: duplicate token id", field=SUPPORT_FIELD, index=t)
    if vocab_size is not None and (a >= vocab_size).any():
        t = int(np.argmax((a >= vocab_size).any(axis=1)))
        raise InputError(f"row {t}: token id outside [0, {vocab_size})", field=SUPPORT_FIELD, index=t)
    offsets = np.zeros(len(a) + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    ids = rows[np.arange(a.shape[1])[None, :] < sizes[:, None]]
    return PackedSupport(ids.astype(np.int32), offsets, vocab_size)


def pack_envelope(arr: np.ndarray, allowed: Sequence[np.dtype], field: str) -> dict:
    """``arr`` as SkyRL's ``{data, shape, dtype}`` envelope (``data`` first)."""
    a = np.ascontiguousarray(arr)
    if a.dtype not in allowed:
        raise InputError(f"dtype {a.dtype.name} is not one of {[d.name for d in allowed]}", field=field)
    return {"data": base64.b64encode(a.tobytes()).decode("ascii"), "shape": list(a.shape),
            "dtype": a.dtype.name}


def unpack_envelope(payload: Mapping, allowed: Sequence[np.dtype], ndim: int, field: str) -> np.ndarray:
    """SkyRL's envelope back to an array (read-only view of the decoded bytes); refused with InputError
    naming ``field``: a missing key, a dtype not in ``allowed``, a shape that is not ``ndim``
    non-negative ints, a byte count that does not match."""
    if not isinstance(payload, Mapping):
        raise InputError(f"expected an object {{data, shape, dtype}}, got {type(payload).__name__}", field=field)
    missing = [k for k in ("data", "shape", "dtype") if k not in payload]
    if missing:
        raise InputError(f"envelope without {missing}", field=field)
    names = {d.name: d for d in allowed}
    dt = names.get(payload["dtype"]) if isinstance(payload["dtype"], str) else None
    if dt is None:
        raise InputError(f"dtype {payload['dtype']!r} is not one of {sorted(names)}", field=field)
    shape = payload["shape"]
    if (not isinstance(shape, (list, tuple)) or len(shape) != ndim
            or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape)):
        raise InputError(f"shape {shape!r} is not {ndim} non-negative ints", field=field)
    try:
        raw = base64.b64decode(payload["data"], validate=True)
    except (binascii.Error, TypeError, ValueError) as e:
        raise InputError(f"malformed base64 ({e})", field=field) from None
    need = math.prod(shape) * dt.itemsize
    if len(raw) != need:
        raise InputError(f"{len(raw)} bytes, {dt.name}{list(shape)} needs {need}", field=field)
    return np.frombuffer(raw, dtype=dt).reshape(shape)


def pack_routes(routes: np.ndarray) -> dict:
    """The ``routed_experts`` envelope of one choice (canonical dtype)."""
    return pack_envelope(routes_to_skyrl(routes), ROUTE_DTYPES, ROUTES_FIELD)


def pack_support(rows: Sequence[Sequence[int]], width: int | None = None) -> dict:
    """The ``rollout_sample_support`` envelope of one choice (:func:`support_array`)."""
    return pack_envelope(support_array(rows, width), SUPPORT_DTYPES, SUPPORT_FIELD)


def unpack_routes(payload: Mapping) -> np.ndarray:
    """A ``routed_experts`` envelope as ``[positions, layers, k]``; a non-canonical dtype is refused."""
    a = unpack_envelope(payload, ROUTE_DTYPES, 3, ROUTES_FIELD)
    if a.size and int(a.min()) < 0:
        raise InputError(f"negative expert id {int(a.min())}", field=ROUTES_FIELD)
    want = canonical_route_dtype(int(a.max(initial=0)))
    if a.dtype != want:
        raise InputError(f"non-canonical dtype {a.dtype.name} for these ids (SkyRL expects {want.name})",
                         field=ROUTES_FIELD)
    return a


def unpack_support(payload: Mapping, vocab_size: int | None = None) -> PackedSupport:
    """A ``rollout_sample_support`` envelope as a :class:`PackedSupport`."""
    return support_from_skyrl(unpack_envelope(payload, SUPPORT_DTYPES, 2, SUPPORT_FIELD), vocab_size)
