"""Gate weights of MoE route capture (R3 with gates).

Gate weights (optional, :meth:`.route_store.RouteStore.enable_gates`): the combine weight of each chosen expert,
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
"""
from __future__ import annotations

from typing import Callable

import numpy as np


class GateRows:
    """The combine weights beside :class:`~.route_store.RouteStore`'s ids: float32 ``[positions, L, k]`` per request
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
