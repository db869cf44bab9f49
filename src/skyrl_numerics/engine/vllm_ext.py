"""The one worker-side extension of the vLLM engine (:class:`SkyrlWorkerExtension`), composed here
from small mixins by concern — in-place weights (:class:`WeightsMixin`), which kernels run the
layers, parameter digests and the host report (:class:`KernelsMixin`), the execution contract
of what the worker runs (:class:`ContractMixin`), the capture of the experts
each MoE router chose (R3, :class:`RoutesMixin`), of the support the sampler kept
(:class:`SupportsMixin`) and of a digest of every sampled position's logits row
(:class:`DigestsMixin`), the tracer's per-module digests (:class:`TraceMixin`,
``trace_capture.py``) — plus the two diagnostic engines of the DeepSeek-V3 attribution, the same
mixins with the attribution schedule recorder (``mla_worker.py``):
:class:`MLAScheduleExtension` and :class:`MLARopeFixExtension`. (Every patch of vLLM's own
classes and objects: ``vllm_patches.py``.)

The capture itself (where each route row goes, prefix-cache hits): ``route_store.py``,
``gate_capture.py``, ``support_store.py``, ``digest_store.py``; vLLM's own fields on CPU:
``aux_outputs.py``. A class here is passed as ``worker_extension_cls`` so vLLM mixes its methods
into the worker (``self`` is the worker); the generator calls them with
``llm.collective_rpc("skyrl_...")``.
"""
from __future__ import annotations

from .digest_store import DigestStore
from .gate_capture import wrap_routing
from .index_capture import start_index_capture
from .mla_worker import AttributionScheduleMixin, MLARopeFixMixin
from .route_store import moe_runners, RouteStore
from .sharded_worker import ShardedSyncWorker
from .support_store import SupportStore
from .trace_capture import TraceMixin
from .vllm_patches import wrap_sampler, wrap_sampler_logits
from .vllm_versions import returns_routed_experts

__all__ = ["SkyrlWorkerExtension", "MLAScheduleExtension", "MLARopeFixExtension", "WeightsMixin",
           "KernelsMixin", "ContractMixin", "RoutesMixin", "SupportsMixin", "DigestsMixin",
           "TraceMixin"]


def _request_amx_permission() -> bool:
    """Ask Linux for AMX tile state in this (worker) process.

    vLLM CPU's attention picks its AMX kernel whenever the CPU has AMX (``_get_attn_isa``) but never
    requests the tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``); a spawned worker that has not
    run an AMX oneDNN kernel yet then dies with SIGILL on its first attention call (seen on the
    Sapphire-Rapids-class hosts here: "Fatal Python error: Illegal instruction" in
    ``cpu_attention_with_kv_cache``). vLLM imports this module while it builds the worker, before
    the model runs, so requesting it here covers every engine that uses this extension. A no-op
    (False) without AMX or on GPU."""
    try:
        import torch

        return bool(torch.cpu._is_amx_tile_supported() and torch._C._cpu._init_amx())
    except Exception:  # pragma: no cover - older torch / non-x86
        return False


_request_amx_permission()


class WeightsMixin:
    """In-place weight loading (caller side: ``sync/vllm.py::update_vllm_weights``)."""

    def skyrl_load_weights(self, path: str) -> dict:
        """Reload the weights in ``path`` (safetensors, checkpoint names) into the live model."""
        import time

        from safetensors import safe_open

        from skyrl_numerics.engine.weight_update import load_into_model

        t0 = time.perf_counter()

        def weights():
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

        n = load_into_model(self.vllm_config, self.model_runner.get_model(), weights(),
                            reload=self.reload_weights)  # the worker's: also resets LoRA/mm state
        return {"loaded": n, "seconds": time.perf_counter() - t0}

    def skyrl_fetch_weights(self, target_version: int, sync_dir: str | None = None,
                            uri: str | None = None) -> dict:
        """SkyRL's ``fetch_weights`` step (route ``/fetch_weights``): the ``skyrl_delta`` backend
        reads and verifies its store up to ``target_version``; the weights do not change yet."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None or not hasattr(engine, "fetch_weights"):
            raise RuntimeError("fetch_weights needs the skyrl_delta weight-transfer backend "
                               "(--weight-transfer-config '{\"backend\": \"skyrl_delta\"}')")
        return engine.fetch_weights(target_version, sync_dir=sync_dir, uri=uri)

    def skyrl_applied_version(self) -> int | None:
        """The version the ``skyrl_delta`` backend last loaded (``None``: none, or another
        backend); the server records it when a client finishes an update without naming one."""
        engine = getattr(self, "weight_transfer_engine", None)
        return (getattr(engine, "last_update", None) or {}).get("version")


class KernelsMixin:
    """What runs the layers (``skyrl_linear_kernels``), parameter digests (for tests) and this
    worker's host report."""

    def skyrl_linear_kernels(self) -> dict[str, str]:
        """Per quantized layer, what runs it: ``"<scheme> / <kernel>"`` (e.g.
        ``"CompressedTensorsWNA16 / CPUWNA16LinearKernel"``), or the quant method's class for
        layers without a scheme (MoE methods, unquantized layers are left out)."""
        out = {}
        for name, mod in self.model_runner.get_model().named_modules():
            scheme = getattr(mod, "scheme", None)
            if scheme is not None:
                kernel = getattr(scheme, "kernel", None)
                out[name] = type(scheme).__name__ + (f" / {type(kernel).__name__}" if kernel is not None else "")
                continue
            qm = getattr(mod, "quant_method", None)
            if qm is not None and not type(qm).__name__.startswith("Unquantized"):
                out[name] = type(qm).__name__
        return out

    def skyrl_weight_digest(self) -> dict[str, str]:
        """blake2b of every parameter's bytes as vLLM holds them (kernel layout; for tests)."""
        import hashlib

        import torch

        out = {}
        for name, p in self.model_runner.get_model().named_parameters():
            t = p.detach().contiguous().cpu()
            out[name] = hashlib.blake2b(t.view(-1).view(torch.uint8).numpy().tobytes(),
                                        digest_size=16).hexdigest()
        return out

    def skyrl_host_info(self) -> dict:
        """This worker's :func:`skyrl_numerics.host.host_info`: its CPU, ISA flags, torch CPU
        capability and the vLLM kernel library it loaded (the generator asks once at start)."""
        import json

        from skyrl_numerics.host import host_info

        # plain JSON types only: vLLM's msgpack reply cannot carry e.g. a TorchVersion, and a
        # reply it cannot encode is never answered (the caller would wait forever)
        return json.loads(json.dumps(host_info()))


class ContractMixin:
    """The execution contract of what this worker runs (``invariant/contract.py``), computed
    here, in the worker: its model, its plan, its KV format, its kernels, its ISA."""

    def skyrl_contract(self) -> dict:
        """:meth:`ExecutionContract.to_dict` of this worker's forward: the batch-invariant model's
        (:func:`~skyrl_numerics.invariant.contract.of_model` on the model's ``core``), else the
        stock vLLM model's (its HF config, dtype, quantization, ``cache_dtype`` and kernel
        library: :func:`~skyrl_numerics.invariant.contract.of_hf`)."""
        import json

        from skyrl_numerics.host import loaded_vllm_build
        from skyrl_numerics.invariant import contract

        model = self.model_runner.get_model()
        core = getattr(model, "core", None)
        if core is not None and hasattr(core, "kv"):
            out = contract.of_model(core)
        else:
            mc, cc = self.vllm_config.model_config, self.vllm_config.cache_config
            quant = mc.quantization
            out = contract.of_hf(mc.hf_config.to_dict(), forward="vllm", dtype=mc.dtype,
                                 kv_format=json.dumps({"format": str(cc.cache_dtype)},
                                                      separators=(",", ":")),
                                 kernel_build=f"vllm {loaded_vllm_build() or 'unknown'}"
                                 + (f"; quantization {quant}" if quant else ""))
        return json.loads(json.dumps(out.to_dict()))   # plain JSON types (msgpack reply)


class RoutesMixin:
    """Route capture (R3): the experts each MoE router chose, per request and position
    (:class:`~.route_store.RouteStore`), and the state of vLLM's own ``routed_experts`` /
    ``sampling_mask`` outputs on CPU (:class:`~.aux_outputs.AuxOutputs`)."""

    def skyrl_route_capture_start(self) -> dict:
        if returns_routed_experts(self.model_runner.vllm_config):
            raise RuntimeError("route capture: this engine returns routed experts itself "
                               "(enable_return_routed_experts; CompletionOutput.routed_experts)"
                               " and its routers already report to it")
        model = self.model_runner.get_model()
        core = getattr(model, "core", None)
        if core is not None and hasattr(core, "route_info"):
            # the batch-invariant model: its own routers report through route_hook, the same
            # ids the trainer's invariant forward computes
            info = core.route_info()
            store = RouteStore(self.model_runner, info["layers"], info["k"], info["num_experts"])
            prev, core.route_hook = core.route_hook, store.capture
            self._skyrl_routes, self._skyrl_route_unhook = store, lambda: setattr(core, "route_hook", prev)
            return {"layers": store.L, "k": store.k, "num_experts": store.num_experts,
                    "layer_ids": list(range(store.L)), "invariant": True}

        mods = moe_runners(model)
        store = RouteStore(self.model_runner, len(mods), mods[0].router.top_k,
                            mods[0].router.global_num_experts)
        for i, m in enumerate(mods):
            m.router.set_capture_fn(lambda ids, _i=i: store.capture(_i, ids))

        def unhook():
            for m in mods:
                m.router.set_capture_fn(None)
        self._skyrl_routes, self._skyrl_route_unhook = store, unhook
        self._skyrl_route_mods = mods
        return {"layers": store.L, "k": store.k, "num_experts": store.num_experts,
                "layer_ids": [int(m.layer_id) for m in mods]}

    def skyrl_gate_capture_start(self) -> dict:
        """Capture each chosen expert's combine weight beside its id from now on
        (:func:`~.gate_capture.wrap_routing`; what vLLM multiplies the expert output with).
        Needs route capture on vLLM's own MoE layers; idempotent."""
        store = getattr(self, "_skyrl_routes", None)
        mods = getattr(self, "_skyrl_route_mods", None)
        if store is None or mods is None:
            raise RuntimeError("gate capture: needs route capture on vLLM's own MoE layers (start the "
                               "engine with capture_routes=True; the batch-invariant engine computes "
                               "the trainer's own weights and has no gate capture)")
        if store.gates is None:
            store.enable_gates()
            undos = [wrap_routing(m, lambda ids, w, _i=i: store.capture(_i, ids, w))
                     for i, m in enumerate(mods)]
            self._skyrl_route_unhook = lambda: [undo() for undo in undos]
        scales = [float(getattr(m, "routed_scaling_factor", 1.0) or 1.0) for m in mods]
        return {"routed_scaling_factor": scales}

    def skyrl_gate_capture_fetch(self, external_ids: list[str], lengths: list[int],
                                 starts: list[int] | None = None) -> list:
        """The combine weights of the rows :meth:`skyrl_route_capture_fetch` returns (call it first,
        with ``clear=False``)."""
        return self._skyrl_routes.fetch_gates(external_ids, lengths, starts)

    def skyrl_aux_output_state(self) -> dict:
        """What :class:`AuxOutputs` holds now (requests with an emit cursor, with routes, with
        support rows); ``{}`` when this engine returns neither output."""
        aux = self.model_runner.__dict__.get("_skyrl_aux")
        if aux is None:
            return {}
        return {"cursors": len(aux.cursors), "generation": aux.generation,
                "routes": None if aux.routes is None else len(aux.routes.per_req),
                "masks": None if aux.masks is None else len(aux.masks.rows)}

    def skyrl_route_capture_fetch(self, external_ids: list[str], lengths: list[int],
                                  clear: bool = True, starts: list[int] | None = None) -> list:
        store = self._skyrl_routes
        out = store.fetch(external_ids, lengths, starts)
        if clear:
            store.clear()
        return out

    def skyrl_route_capture_stop(self) -> None:
        if getattr(self, "_skyrl_routes", None) is None:
            return
        self._skyrl_route_unhook()
        self._skyrl_routes = None
        self._skyrl_route_mods = None


class IndexMixin:
    """DSA indexer capture: the key positions each query of a batch-invariant DeepSeek-V3.2
    attends to, per request and position (``index_capture.py``)."""

    def skyrl_index_capture_start(self) -> dict:
        """Idempotent; ``{"layers", "topk", "bound"}``."""
        if getattr(self, "_skyrl_index", None) is None:
            self._skyrl_index, self._skyrl_index_unhook, self._skyrl_index_info = (
                start_index_capture(self.model_runner))
        return self._skyrl_index_info

    def skyrl_index_capture_fetch(self, external_ids: list[str], lengths: list[int],
                                  clear: bool = True, starts: list[int] | None = None) -> list:
        """Rows of positions ``start .. length - 1`` (as ``skyrl_route_capture_fetch``)."""
        store = self._skyrl_index
        out = store.fetch(external_ids, lengths, starts)
        if clear:
            store.clear()
        return out

    def skyrl_index_capture_stop(self) -> None:
        if getattr(self, "_skyrl_index", None) is None:
            return
        self._skyrl_index_unhook()
        self._skyrl_index = None


class SupportsMixin:
    """Support capture (top-p / top-k: the set the sampler kept,
    :class:`~.support_store.SupportStore`)."""

    def skyrl_support_capture_start(self) -> bool:
        """Wrap the runner's top-k/top-p sampler so every sampled token's support is recorded
        (:class:`SupportStore`). Idempotent; returns True once installed."""
        if getattr(self, "_skyrl_support", None) is not None:
            return True
        store = SupportStore(self.model_runner)
        self._skyrl_support_unhook = wrap_sampler(self.model_runner, store)
        self._skyrl_support = store
        return True

    def skyrl_support_capture_fetch(self, external_ids: list[str], starts: list[int],
                                    lengths: list[int], clear: bool = True) -> list:
        store = self._skyrl_support
        out = store.fetch(external_ids, starts, lengths)
        if clear:
            store.clear()
        return out

    def skyrl_support_capture_stop(self) -> None:
        if getattr(self, "_skyrl_support", None) is None:
            return
        self._skyrl_support_unhook()
        self._skyrl_support = None


class DigestsMixin:
    """Logits digests (a digest of the full logits row of every sampled position,
    :class:`~.digest_store.DigestStore`; the row and the digest: :mod:`skyrl_numerics.gap.digest`)."""

    def skyrl_logits_digest_start(self, algo: str) -> str:
        """Wrap the runner's sampler so every row it receives is hashed with ``algo``.
        Idempotent for the same algorithm (another one replaces the store); returns ``algo``."""
        store = getattr(self, "_skyrl_digest", None)
        if store is not None and store.algo == algo:
            return algo
        self.skyrl_logits_digest_stop()
        store = DigestStore(self.model_runner, algo)
        self._skyrl_digest_unhook = wrap_sampler_logits(self.model_runner, store)
        self._skyrl_digest = store
        return algo

    def skyrl_logits_digest_fetch(self, external_ids: list[str], starts: list[int],
                                  lengths: list[int], clear: bool = True) -> list:
        store = self._skyrl_digest
        out = store.fetch(external_ids, starts, lengths)
        if clear:
            store.clear()
        return out

    def skyrl_logits_digest_keep_rows(self, on: bool) -> None:
        """Also keep the float32 rows (for the one-position replay; off again after it)."""
        self._skyrl_digest.keep_rows = bool(on)
        if not on:
            self._skyrl_digest.kept.clear()

    def skyrl_logits_digest_row(self, external_id: str, pos: int):
        return self._skyrl_digest.fetch_row(external_id, pos)

    def skyrl_logits_digest_stop(self) -> None:
        if getattr(self, "_skyrl_digest", None) is None:
            return
        self._skyrl_digest_unhook()
        self._skyrl_digest = None


# ---- the extensions: the mixins composed ------------------------------------------------------

class SkyrlWorkerExtension(WeightsMixin, ShardedSyncWorker, KernelsMixin, ContractMixin, RoutesMixin,
                           IndexMixin, SupportsMixin, DigestsMixin, TraceMixin):
    """The one worker extension (``WORKER_EXTENSION`` of ``generator.py`` / ``server.py`` /
    ``sync/vllm.py``): in-place weight loading (``skyrl_load_weights``, the load path of
    ``sync/vllm.py``; ``skyrl_shard_*``, the sharded transfer of ``sync/sharded.py``), which kernels
    run the layers, parameter digests, the host report, the execution contract, route capture, DSA
    indexer capture, support capture,
    logits digests and the layer-by-layer tracer's hooks (``skyrl_trace_*``, ``trace_capture.py``)."""


class MLAScheduleExtension(AttributionScheduleMixin, SkyrlWorkerExtension):
    """:class:`SkyrlWorkerExtension` plus a recorder of each forward's batch layout, started with
    route capture (``mla_attribution.EXTENSION``; see
    :class:`~skyrl_numerics.engine.mla_worker.AttributionScheduleMixin`)."""


class MLARopeFixExtension(MLARopeFixMixin, AttributionScheduleMixin, SkyrlWorkerExtension):
    """:class:`MLAScheduleExtension`'s recorder plus the engine's MLA rotary calls fixed at route
    capture start (``mla_attribution.ROPE_FIX_EXTENSION``; see
    :class:`~skyrl_numerics.engine.mla_worker.MLARopeFixMixin`)."""
