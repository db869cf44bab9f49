"""vLLM's own auxiliary outputs (``routed_experts``, ``sampling_mask``) filled on the V1 (CPU)
model runner from the route and support stores; driven by the runner patches of
``vllm_patches.py``."""
from __future__ import annotations

import numpy as np

from .route_store import moe_runners, RouteStore
from .support_store import SupportStore
from .vllm_patches import wrap_sampler
from .vllm_versions import returns_routed_experts


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
