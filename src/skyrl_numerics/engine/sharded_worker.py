"""The engine side of the sharded delta transfer (:mod:`skyrl_numerics.sync.sharded`): the worker
extension methods each vLLM rank runs (prepare its own links, then commit or abort) and
:func:`sharded_update`, which switches every rank of a running engine or none."""
from __future__ import annotations

from skyrl_numerics.engine.weight_update import engine_of, load_into_model
from skyrl_numerics.errors import InputError
from skyrl_numerics.sync.sharded import ShardedReceiver, spec_digest


def engine_rank(worker) -> int:
    """The rank of a vLLM worker in :func:`shard_layouts.vllm_layout` numbering (dp·tp + tp)."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    pc = worker.vllm_config.parallel_config
    return int(getattr(pc, "data_parallel_rank", 0) or 0) * get_tensor_model_parallel_world_size() + \
        get_tensor_model_parallel_rank()


class ShardedSyncWorker:
    """Worker-extension methods (``collective_rpc("skyrl_shard_...")``) of the engine side."""

    def skyrl_shard_prepare(self, root: str, spec: dict, version: int, fill: float | None = None) -> dict:
        import time

        t0 = time.perf_counter()
        rank = engine_rank(self)
        key = (str(root), spec_digest(spec))
        r = getattr(self, "_skyrl_shards", None)
        try:
            if r is None or (r.root, r.digest) != key or r.rank != rank:
                r = self._skyrl_shards = ShardedReceiver(root, spec, rank)
            r.fill = fill
            self._skyrl_shard_pending = r.prepare(int(version))
        except InputError as e:
            self._skyrl_shard_pending = None
            return {"rank": rank, "ok": False, "error": str(e)}
        return {"rank": rank, "ok": True, "bytes_read": self._skyrl_shard_pending.bytes_read,
                "seconds": time.perf_counter() - t0}

    def skyrl_shard_commit(self, version: int) -> dict:
        import time

        t0 = time.perf_counter()
        p = getattr(self, "_skyrl_shard_pending", None)
        if p is None or p.version != int(version):
            raise InputError(f"engine rank {engine_rank(self)}: version {version} was not prepared",
                             field="version")
        self._skyrl_shard_pending = None
        weights = self._skyrl_shards.commit(p)
        n = load_into_model(self.vllm_config, self.model_runner.get_model(), iter(weights),
                            reload=self.reload_weights)
        return {"rank": engine_rank(self), "loaded": n, "seconds": time.perf_counter() - t0}

    def skyrl_shard_abort(self) -> None:
        self._skyrl_shard_pending = None


def sharded_update(llm, root, spec: dict, version: int, *, fill: float | None = None) -> dict:
    """Switch every rank of a running engine (``vllm.LLM`` or ``VLLMGenerator``) to ``version``:
    prepare everywhere, then commit everywhere or abort everywhere (module docstring). ``fill``:
    what the HF tensors hold outside the rank's boxes (default: never written; NaN in tests, so a
    box the plan misses shows up in the loaded weights). Returns
    ``{"version", "bytes_read": {rank: n}, "prepare_s", "commit_s"}``."""
    engine = engine_of(llm)
    got = engine.collective_rpc("skyrl_shard_prepare", args=(str(root), spec, int(version), fill))
    bad = [g for g in got if not g["ok"]]
    if bad:
        engine.collective_rpc("skyrl_shard_abort")
        raise InputError(f"engine rank {bad[0]['rank']} refused version {version}: {bad[0]['error']} "
                         "(no rank switched)", field="version")
    done = engine.collective_rpc("skyrl_shard_commit", args=(int(version),))
    return {"version": int(version), "bytes_read": {g["rank"]: g["bytes_read"] for g in got},
            "prepare_s": max(g["seconds"] for g in got), "commit_s": max(d["seconds"] for d in done)}
