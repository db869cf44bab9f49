"""vLLM 0.32's own wire formats for R3 routes and sampled supports, decoded into our types.

Routes (``choice.routed_experts``, completions and ``/generate``): base64 (standard alphabet, padded) of
the ``.npy`` bytes of one array ``[positions, num_total_hidden_layers, k]`` per choice
(``vllm.utils.serial_utils.numpy2base64``), uint8 when ``num_experts <= 256`` else uint16, one row per
position from ``routed_experts_prompt_start`` to ``prompt_len + response_len - 2`` (the final sampled
token is never run). Layers are indexed over *all* hidden layers: layers vLLM never routes (dense layers,
e.g. DeepSeek's ``first_k_dense_replace`` leading ones) stay 0 in its zero-initialized capture buffer.

Supports (``choice.sampling_mask``, ``/generate`` with ``return_sampling_mask``): per choice a
``list[list[int]]``, the vocabulary ids kept by top-k / top-p / min-p, one list per generated token.

Decoding never unpickles: the ``.npy`` header is parsed with :mod:`numpy.lib.format` (versions 1.0 and
2.0, integer dtypes only) and the data must have exactly the bytes the header announces, then is viewed
with ``np.frombuffer`` (no ``np.load``: no pickle, no ``.npz`` zip path, no allocation sized by the header).
"""
from __future__ import annotations

import base64
import binascii
import io
import math
from typing import Sequence

import numpy as np

from skyrl_numerics.errors import InputError

from .routes import PackedRoutes, exact_int, exact_ints, id_dtype

_NPY_MAGIC = b"\x93NUMPY"
_MAX_NPY_HEADER = 1 << 16


def encode_vllm_routes(arr: np.ndarray) -> str:
    """``arr`` as vLLM's ``numpy2base64`` writes it (``.npy`` bytes, base64): the same string."""
    with io.BytesIO() as buf:
        np.save(buf, arr, allow_pickle=False)
        return base64.b64encode(buf.getbuffer()).decode("ascii")


def _err(msg: str, choice: int | None, index: int | None = None, field: str = "routed_experts") -> InputError:
    where = "" if choice is None else f"choice {choice}: "
    return InputError(where + msg, row=choice, field=field, index=index)


def _load(x, choice: int | None) -> np.ndarray:
    """One choice's routes: base64 str -> bytes -> ``.npy`` -> ndarray view (ndarray: as is)."""
    if x is None:
        raise _err("no routes (server without enable_return_routed_experts, or request aborted before any "
                   "forward pass)", choice)
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, str):
        try:
            x = base64.b64decode(x, validate=True)
        except (binascii.Error, ValueError) as e:
            raise _err(f"malformed base64 ({e})", choice) from None
    if not isinstance(x, (bytes, bytearray, memoryview)):
        raise _err(f"expected base64 str, .npy bytes or ndarray, got {type(x).__name__}", choice)
    try:
        raw = memoryview(x).cast("B")
    except TypeError as e:                      # a non-contiguous or multi-dimensional memoryview
        raise _err(f"not a contiguous byte buffer ({e})", choice) from None
    fp = io.BytesIO(bytes(raw[:_MAX_NPY_HEADER]))
    try:
        if bytes(raw[:6]) != _NPY_MAGIC:
            raise ValueError(f"bad magic {bytes(raw[:6])!r}")
        version = np.lib.format.read_magic(fp)
        if version == (1, 0):
            shape, fortran, dt = np.lib.format.read_array_header_1_0(fp)
        elif version == (2, 0):
            shape, fortran, dt = np.lib.format.read_array_header_2_0(fp)
        else:
            raise ValueError(f"unsupported .npy version {version}")
    except (ValueError, TypeError, SyntaxError, OverflowError, EOFError) as e:
        raise _err(f"malformed .npy ({e})", choice) from None
    if dt.kind not in "iu":
        raise _err(f"expert ids must be integers, got dtype {dt}", choice)
    if len(shape) != 3:
        raise _err(f"expected [positions, layers, k], got shape {shape}", choice)
    off, need = fp.tell(), math.prod(shape) * dt.itemsize
    if len(raw) - off != need:
        raise _err(f".npy data has {len(raw) - off} bytes, header {shape} {dt} needs {need} "
                   f"(truncated or trailing bytes)", choice)
    return np.frombuffer(raw, dtype=dt, count=math.prod(shape), offset=off).reshape(
        shape, order="F" if fortran else "C")


def _layer_index(moe_layers, num_layers: int, field: str = "moe_layers") -> np.ndarray:
    m = exact_ints(moe_layers, field).reshape(-1)
    if m.size == 0:
        raise InputError("no MoE layers given", field=field)
    bad = (m < 0) | (m >= num_layers)
    if bad.any():
        i = int(np.argmax(bad))
        raise InputError(f"layer {int(m[i])} outside [0, {num_layers}) hidden layers", field=field, index=i)
    if m.size > 1 and (np.diff(m) <= 0).any():
        i = int(np.argmax(np.diff(m) <= 0)) + 1
        raise InputError(f"must be strictly increasing, got {int(m[i - 1])} then {int(m[i])}", field=field, index=i)
    return m


def _checked(x, num_experts: int, choice: int | None, rows: int | None, moe_layers, ref):
    """Decode + validate one choice; returns (array [n, L_total, k], kept layer index or None)."""
    a = _load(x, choice)
    if a.ndim != 3:
        raise _err(f"expected [positions, layers, k], got shape {a.shape}", choice)
    if a.dtype.kind not in "iu":
        raise _err(f"expert ids must be integers, got dtype {a.dtype}", choice)
    if a.shape[1] < 1 or a.shape[2] < 1:
        raise _err(f"need >= 1 layer and k >= 1, got shape {a.shape}", choice)
    if ref is not None and a.shape[1:] != ref:
        raise _err(f"(layers, k) = {a.shape[1:]} differ from choice 0's {ref}", choice)
    if rows is not None and a.shape[0] != rows:
        raise _err(f"{a.shape[0]} route rows, expected prompt_len + response_len - 1 - prompt_start = {rows}",
                   choice)
    if a.size:
        bad = None
        if a.dtype.kind == "i" and int(a.min()) < 0:
            bad = a < 0
        elif not (a.dtype.kind == "u" and num_experts >= 1 << (8 * a.dtype.itemsize)) and int(a.max()) >= num_experts:
            bad = a >= num_experts
        if bad is not None:
            p, layer, s = (int(v) for v in np.unravel_index(int(np.argmax(bad)), a.shape))
            raise _err(f"expert id {int(a[p, layer, s])} outside [0, {num_experts}) at position {p}, layer {layer}, "
                       f"slot {s}", choice, index=p)
    layers = None if moe_layers is None else _layer_index(moe_layers, a.shape[1])
    if layers is not None and a.shape[0]:
        dropped = np.setdiff1d(np.arange(a.shape[1]), layers)
        nz = a[:, dropped].any(axis=2) if dropped.size else None
        if nz is not None and nz.any():
            p, j = (int(v) for v in np.unravel_index(int(np.argmax(nz)), nz.shape))
            raise _err(f"layer {int(dropped[j])} is not in moe_layers but holds routes at position {p} (vLLM leaves "
                       f"unrouted layers at 0): wrong moe_layers?", choice, index=p)
    return a, layers


def decode_vllm_routes(encoded, num_experts: int, *, moe_layers: Sequence[int] | None = None,
                       rows: int | None = None) -> np.ndarray:
    """One choice's ``routed_experts`` as ``[n, L, k]`` of :func:`id_dtype` (``L = len(moe_layers)``), checked
    like :meth:`PackedRoutes.from_vllm`; ``rows``: expected row count. For ``routed_experts_prompt_start
    = s > 0`` deltas: ``RouteTrace.add(decode_vllm_routes(...), start=s)``."""
    E = exact_int(num_experts, "num_experts")
    dt = id_dtype(E)
    a, layers = _checked(encoded, E, None, rows, moe_layers, None)
    return (a if layers is None else a[:, layers]).astype(dt)


def _per_choice(x, B: int, field: str) -> np.ndarray:
    v = exact_ints(x, field)
    v = np.full(B, int(v), np.int64) if v.ndim == 0 else v.reshape(-1)
    if v.size != B:
        raise InputError(f"{v.size} entries for {B} choices", field=field)
    if v.size and v.min() < 0:
        raise InputError(f"negative value {int(v.min())}", field=field, row=int(np.argmin(v)))
    return v


def routes_from_vllm(encoded, num_experts, *, prompt_lens=None, response_lens=None, prompt_start=0,
                     moe_layers=None) -> PackedRoutes:
    """Implementation of :meth:`PackedRoutes.from_vllm`."""
    if isinstance(encoded, (str, bytes, bytearray, np.ndarray)) or not hasattr(encoded, "__len__"):
        raise InputError(f"expected a sequence with one entry per choice, got {type(encoded).__name__}",
                         field="routed_experts")
    encoded = list(encoded)
    B = len(encoded)
    if not B:
        raise InputError("no choices given", field="routed_experts")
    E = exact_int(num_experts, "num_experts")
    id_dtype(E)
    starts = _per_choice(prompt_start, B, "prompt_start")
    if (prompt_lens is None) != (response_lens is None):
        raise InputError("prompt_lens and response_lens come together", field="prompt_lens")
    rows = None
    if prompt_lens is not None:
        P, R = _per_choice(prompt_lens, B, "prompt_lens"), _per_choice(response_lens, B, "response_lens")
        if (starts > P).any():
            b = int(np.argmax(starts > P))
            raise InputError(f"prompt_start {int(starts[b])} > prompt_len {int(P[b])}", field="prompt_start", row=b)
        rows = P + R - 1 - starts
        if (rows < 0).any():
            b = int(np.argmax(rows < 0))
            raise InputError(f"prompt_len + response_len = {int(P[b] + R[b])} tokens: nothing was run",
                             field="prompt_lens", row=b)
    if starts.any():
        b = int(np.argmax(starts > 0))
        raise InputError(f"choice {b}: routes start at prompt position {int(starts[b])} (routed_experts_prompt_start); "
                         f"a PackedRoutes needs every position from 0: use decode_vllm_routes() and "
                         f"RouteTrace.add(delta, start={int(starts[b])})", field="prompt_start", row=b)
    arrays, ref, layers = [], None, None
    for b, x in enumerate(encoded):
        a, layers = _checked(x, E, b, None if rows is None else int(rows[b]), moe_layers, ref)
        ref = a.shape[1:]
        arrays.append(a)
    out = PackedRoutes.empty([a.shape[0] for a in arrays], ref[0] if layers is None else layers.size, ref[1], E)
    for b, a in enumerate(arrays):
        np.copyto(out.seq(b), a if layers is None else a[:, layers], casting="unsafe")  # ids checked < E
    return out


def routes_to_vllm(r: PackedRoutes, b: int, num_hidden_layers: int | None, moe_layers) -> str:
    """Implementation of :meth:`PackedRoutes.to_vllm`."""
    s = r.seq(b)
    if moe_layers is None:
        if num_hidden_layers is not None and exact_int(num_hidden_layers, "num_hidden_layers") != r.num_layers:
            raise InputError(f"{num_hidden_layers} hidden layers but {r.num_layers} route layers: pass moe_layers",
                             field="num_hidden_layers")
        return encode_vllm_routes(s)
    if num_hidden_layers is None:
        raise InputError("moe_layers needs num_hidden_layers", field="num_hidden_layers")
    layers = _layer_index(moe_layers, exact_int(num_hidden_layers, "num_hidden_layers"))
    if layers.size != r.num_layers:
        raise InputError(f"{layers.size} moe_layers for {r.num_layers} route layers", field="moe_layers")
    full = np.zeros((s.shape[0], int(num_hidden_layers), r.k), dtype=s.dtype)
    full[:, layers] = s
    return encode_vllm_routes(full)


# ---- sampling_mask ------------------------------------------------------------------------------------
def support_from_vllm(masks, vocab_size: int, *, response_lens=None, token_ids=None):
    """Implementation of :meth:`PackedSupport.from_vllm`."""
    from .support import PackedSupport

    if isinstance(masks, (str, bytes)) or not hasattr(masks, "__len__"):
        raise InputError(f"expected a sequence with one entry per choice, got {type(masks).__name__}",
                         field="sampling_mask")
    masks = list(masks)
    B = len(masks)
    V = exact_int(vocab_size, "vocab_size")
    if not 1 <= V <= 2 ** 31:
        raise InputError(f"vocab_size {V} outside [1, 2**31]", field="vocab_size")
    lens = None if response_lens is None else _per_choice(response_lens, B, "response_lens")
    if token_ids is not None and len(token_ids) != B:
        raise InputError(f"{len(token_ids)} token_ids lists for {B} choices", field="token_ids")
    flat, sizes, cu = [], [], [0]
    for c, m in enumerate(masks):
        m = getattr(m, "token_ids", m)          # vllm.outputs.SamplingMask
        if m is None:
            raise _err("no sampling_mask (server without return_sampling_mask)", c, field="sampling_mask")
        if isinstance(m, (str, bytes, dict)) or not hasattr(m, "__len__"):
            raise _err(f"expected a list of per-token id lists, got {type(m).__name__}", c, field="sampling_mask")
        for want in ([] if lens is None else [int(lens[c])]) + ([] if token_ids is None else [len(token_ids[c])]):
            if len(m) != want:
                raise _err(f"{len(m)} mask rows for a response of {want} tokens", c, field="sampling_mask")
        for i, row in enumerate(m):
            if isinstance(row, np.ndarray):
                row = row.tolist()
            if not isinstance(row, (list, tuple)):
                raise _err(f"expected a list of token ids (one per generated token), got {type(row).__name__}",
                           c, i, field="sampling_mask")
            if not row:
                raise _err("empty support", c, i, field="sampling_mask")
            sizes.append(len(row))
            flat.extend(row)
        cu.append(len(sizes))
    offsets = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    cu = np.asarray(cu)

    def where(j: int):                          # entry j -> (choice, position)
        r = int(np.searchsorted(offsets, j, side="right")) - 1
        c = int(np.searchsorted(cu, r, side="right")) - 1
        return c, r - int(cu[c])

    if not set(map(type, flat)) <= {int}:
        for j, v in enumerate(flat):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise _err(f"token id {v!r} is not an integer", *where(j), field="sampling_mask")
    try:
        ids = np.array(flat, dtype=np.int64)
    except OverflowError:
        j = next(j for j, v in enumerate(flat) if not -2 ** 63 <= v < 2 ** 63)
        raise _err(f"token id {flat[j]} outside [0, {V})", *where(j), field="sampling_mask") from None
    bad = (ids < 0) | (ids >= V)
    if bad.any():
        j = int(np.argmax(bad))
        raise _err(f"token id {int(ids[j])} outside [0, {V})", *where(j), field="sampling_mask")
    rid = np.repeat(np.arange(len(sizes)), sizes)
    same = rid[1:] == rid[:-1]
    if (same & (np.diff(ids) <= 0)).any():       # vLLM sends sorted rows; sort otherwise
        ids = ids[np.lexsort((ids, rid))]
        dup = same & (np.diff(ids) == 0)
        if dup.any():
            j = int(np.argmax(dup)) + 1
            raise _err(f"duplicate token id {int(ids[j])}", *where(j), field="sampling_mask")
    out = PackedSupport(ids.astype(np.int32), offsets, V)
    if token_ids is not None:
        tgt = [t for ts in token_ids for t in ts]
        hit = out.contains(exact_ints(tgt, "token_ids")) if tgt else np.ones(0, bool)
        if not hit.all():
            r = int(np.argmin(hit))
            c = int(np.searchsorted(cu, r, side="right")) - 1
            raise _err(f"sampled token {int(tgt[r])} is not in its support (misaligned mask?)", c, r - int(cu[c]),
                       field="sampling_mask")
    return out
