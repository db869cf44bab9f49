"""The vLLM worker parts of the MLA attribution: mixins of the one worker extension
(composed in ``engine/vllm_ext.py`` as ``MLAScheduleExtension`` and
``MLARopeFixExtension``; ``self`` is the vLLM worker).

:class:`AttributionScheduleMixin` records each forward's batch layout (what
:func:`~.schedule.recorded_steps` maps to a rollout's rows); :class:`MLARopeFixMixin` fixes the
engine's rotary calls on MLA's views instead (the instance patch ``"mla.rotary_emb"`` of
``vllm_patches.py``). Both start with route capture (``skyrl_route_capture_start``), before any
request runs.
"""
from __future__ import annotations

import torch

from skyrl_numerics.engine.vllm_patches import rowwise_mla_rope


# ----------------------------------------------------------------------------------------------
# the engine's batch layout, recorded in the worker (for vllm_cpu_rope)

class AttributionScheduleMixin:
    """A recorder of each forward's batch layout.

    Pass ``MLAScheduleExtension`` as ``VLLMGenerator(..., capture_routes=True,
    worker_extension_cls=EXTENSION)``: when the generator starts route capture, a forward pre-hook
    on the model's token embedding starts recording, per engine step, the scheduled tokens in
    batch order as ``(request id, position, token id)``. :func:`recorded_steps` fetches them and
    maps them to a rollout's rows."""

    def skyrl_route_capture_start(self) -> dict:
        info = super().skyrl_route_capture_start()
        self.skyrl_mla_schedule_start()
        return info

    def skyrl_mla_schedule_start(self) -> bool:
        if getattr(self, "_skyrl_sched_handle", None) is not None:
            return False
        runner = self.model_runner
        model = runner.get_model()
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if not isinstance(emb, torch.nn.Module):
            emb = model.model.embed_tokens
        steps: list = []

        def pre_hook(module, args):
            ids = args[0]
            ib = runner.input_batch
            n_req = ib.num_reqs
            qsl = [int(x) for x in runner.query_start_loc.np[: n_req + 1]]
            n = qsl[-1]
            pos = runner.positions[:n].cpu().tolist()
            tok = ids[:n].cpu().tolist()
            reqs = []
            for b in range(n_req):
                reqs += [str(ib.req_ids[b])] * (qsl[b + 1] - qsl[b])
            steps.append([reqs, pos, tok])

        self._skyrl_sched = steps
        self._skyrl_sched_handle = emb.register_forward_pre_hook(pre_hook)
        return True

    def skyrl_mla_schedule_fetch(self, clear: bool = True) -> list:
        steps = list(getattr(self, "_skyrl_sched", []))
        if clear and steps:
            self._skyrl_sched.clear()
        return steps


class MLARopeFixMixin:
    """*Fixes* the engine: every MLA layer's rotary call goes through 2-D contiguous copies
    (``vllm_patches._RowwiseRope``, the instance patch ``"mla.rotary_emb"``), so vLLM CPU rotates
    every query head and key by its own position. Installed when the generator starts route
    capture (pass ``capture_routes=True``), before any request runs; kept for the engine's
    life."""

    def skyrl_route_capture_start(self) -> dict:
        info = super().skyrl_route_capture_start()
        n, _undo = rowwise_mla_rope(self.model_runner.get_model())
        if n == 0:
            raise RuntimeError("MLARopeFixExtension: the model has no MLA layers")
        return info
