"""Route capture inside a vLLM worker: the experts each MoE router chose (R3,
:class:`RouteStore`), per request and per KV slot. Used by the worker extension (``vllm_ext.py``)
and by vLLM's own ``routed_experts`` output on CPU (:mod:`.aux_outputs`). The sibling stores:
gate weights (:mod:`.gate_capture`), the sampler's support (:mod:`.support_store`), the logits
digest (:mod:`.digest_store`).

GPU vLLM has ``enable_return_routed_experts``; vLLM CPU does not (it lives in the V2 model runner,
which needs Triton on GPU). The worker extension is passed as ``worker_extension_cls`` so vLLM mixes
its methods into the worker, and the generator calls them with ``llm.collective_rpc("skyrl_...")``.

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

Two ways out: over ``collective_rpc`` (``skyrl_route_capture_*``, what ``VLLMGenerator`` calls),
or vLLM's own response field: with ``--enable-return-routed-experts`` on vLLM CPU the patches of
``vllm_patches.py`` drive :class:`~.aux_outputs.AuxOutputs`, which fills ``routed_experts`` of a
stock ``vllm serve`` the way vLLM's GPU Model Runner V2 does (no RPC).
"""
from __future__ import annotations

import numpy as np

from .gate_capture import GateRows
from .sampled_rows import external_id


class RouteStore:
    """Routes ``[positions, num_layers, k]`` per request and per KV slot.

    ``layers``: the layer indices the routers report, in forward order (default ``0 ..
    num_layers - 1``); a forward starts at the first and ends at the last. vLLM's own layout
    (:class:`~.aux_outputs.AuxOutputs`) indexes by each MoE module's ``layer_id`` over all hidden layers: the
    rows of dense layers are never written and stay 0, as in vLLM's GPU capture buffer.
    """

    def __init__(self, runner, num_layers: int, k: int, num_experts: int, layers=None):
        self.runner = runner
        self.L = int(num_layers)
        self.k = int(k)
        self.num_experts = int(num_experts)
        # uint32 past 65536: the DSA indexer's key positions (index_capture.py) share this store
        self.dtype = (np.uint8 if self.num_experts <= 256 else np.uint16
                      if self.num_experts <= 1 << 16 else np.uint32)
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
        by_ext = {external_id(req): req for req in self.per_req}
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
            base = external_id(req)
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
