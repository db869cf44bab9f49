"""A multi-rank trainer inside the RL loop: one Ray actor per rank, one process group.

``TrainerGroup(model_dir, config, sync_dir, snapshot_every, backend="megatron", tp=2, ep=2)``
reserves a placement group of ``max(tp, ep)`` bundles (PACK: one node when it fits), starts one
:class:`RankActor` per bundle, and each actor joins one gloo group (NCCL where CUDA is there; the
address and a free port chosen by the driver) and builds the loop's
:class:`~skyrl_numerics.trainer.workers.TrainerWorker` on its rank — a
:class:`~skyrl_numerics.trainer.megatron.trainer.MegatronTrainer` at tensor parallel ``tp`` x expert
parallel ``ep``.

With ``backend="fsdp", dp=N`` the ranks are an FSDP2 data-parallel group
(:class:`~skyrl_numerics.trainer.fsdp.trainer.FSDPTrainer`: each rank its block of sequences,
parameters sharded per decoder layer) and rank 0 publishes the weights gathered to it (the delta
sync of ``weight_sync.py``).

The group answers the loop's trainer calls (``logprobs``, ``step``, ``served_state``,
``last_grads``, ``host_info``, ``close``) by calling every rank at once and returning rank 0's
answer: every megatron rank runs every micro-batch (no data parallelism) and FSDP's logprobs and
metrics are reduced over its ranks, so the answers agree, and the collectives inside (TP
all-reduces, the vocab-parallel log-softmax, FSDP's gathers) need every rank in the call.

Weights reach the engine by sharded transfer (``sync/sharded.py``): on ``publish`` every rank
publishes the links of its own shards (no rank gathers a tensor), and rank 0 seals the version once
all ranks returned; the generator gets ``{root, spec, version}`` and each engine rank reads only its
links.
"""
from __future__ import annotations

import os

from skyrl_numerics.errors import InputError


class RankActor:
    """One rank: joins the group, then serves ``call(name, *args)`` on its ``TrainerWorker``."""

    def __init__(self, rank: int, world: int, addr: str, port: int, threads: int, args: tuple,
                 kwargs: dict):
        import torch

        from skyrl_numerics.trainer.dist import init_distributed
        from skyrl_numerics.trainer.workers import TrainerWorker

        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        torch.set_num_threads(threads)
        init_distributed()
        self.worker = TrainerWorker(*args, **kwargs)

    def call(self, name: str, *args, **kwargs):
        return getattr(self.worker, name)(*args, **kwargs)

    def shutdown(self) -> None:
        import torch.distributed as dist

        self.worker.close()
        if dist.is_initialized():
            dist.destroy_process_group()


class TrainerGroup:
    """The loop's trainer over ``max(tp, ep)`` rank actors (module docstring)."""

    def __init__(self, model_dir: str, config, sync_dir: str, snapshot_every: int, *,
                 backend: str = "megatron", tp: int = 1, ep: int = 1, dp: int = 1,
                 timeout_s: float = 300.0):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from skyrl_numerics.trainer.dist import free_port

        if backend == "megatron":
            from skyrl_numerics.trainer.megatron.model import check_parallel_config

            check_parallel_config(model_dir, tp, ep)     # before any actor starts
            self.world = max(tp, ep)
        elif backend == "fsdp":
            if dp < 1:
                raise InputError(f"dp={dp}: need at least one rank", field="dp")
            self.world = dp
        else:
            raise InputError(f"unknown backend {backend!r}", field="backend")
        self.backend = backend
        if not ray.is_initialized():
            raise InputError("TrainerGroup needs a running Ray (ray.init())", field="ray")
        share = min(1.0, ray.available_resources().get("CPU", 1.0) / self.world)
        self.pg = placement_group([{"CPU": share}] * self.world, strategy="PACK")
        if not ray.get(self.pg.ready(), timeout=timeout_s):   # pragma: no cover - ray raises instead
            raise InputError(f"no room for {self.world} trainer ranks", field="ray")
        addr, port = "127.0.0.1", free_port()
        Actor = ray.remote(RankActor)
        threads = max(1, (os.cpu_count() or 1) // self.world)
        args = (str(model_dir), config, str(sync_dir), snapshot_every, backend)
        self.ranks = []
        try:
            for r in range(self.world):
                opts = dict(num_cpus=share, scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=r))
                kw = dict(tp=tp, ep=ep) if backend == "megatron" else {}
                self.ranks.append(Actor.options(**opts).remote(r, self.world, addr, port, threads, args, kw))
            # the constructors publish version 0 of every link; ready when all returned
            infos = ray.get([a.call.remote("host_info") for a in self.ranks], timeout=timeout_s)
            self.hosts = infos
            self.info = (ray.get(self.ranks[0].call.remote("seal", 0)) if backend == "megatron"
                         else None)
        except BaseException:
            for a in self.ranks:
                ray.kill(a)
            remove_placement_group(self.pg)
            raise

    def _all(self, name: str, *args, **kwargs) -> list:
        import ray

        return ray.get([a.call.remote(name, *args, **kwargs) for a in self.ranks])

    # ---- the loop's trainer interface ------------------------------------------------------------
    def logprobs(self, rollout):
        return self._all("logprobs", rollout)[0]

    def step(self, rollout, rewards, old_logprobs) -> dict:
        return self._all("step", rollout, rewards, old_logprobs)[0]

    def served_state(self) -> dict:
        return self._all("served_state")[0]

    def last_grads(self) -> dict:
        return self._all("last_grads")[0]

    def host_info(self) -> dict:
        return self.hosts[0]

    def contract(self) -> dict:
        """Rank 0's execution contract (the group is never a bitwise trainer: recorded only)."""
        import ray

        return ray.get(self.ranks[0].call.remote("contract"))

    def sharded_info(self) -> dict:
        return self.info

    def publish(self, full: bool = False) -> dict:
        import ray

        outs = self._all("publish", full=full)
        if self.backend == "fsdp":      # the weights were gathered to rank 0, which published them
            return outs[0]
        versions = {o["version"] for o in outs if o["version"] is not None}
        if len(versions) != 1:
            raise InputError(f"trainer ranks published different versions {sorted(versions)}",
                             field="version")
        v = versions.pop()
        self.info = ray.get(self.ranks[0].call.remote("seal", v))
        return {"version": v, "full": all(o["full"] for o in outs),
                "changed": sum(o["changed"] for o in outs),
                "payload_bytes": sum(o["payload_bytes"] for o in outs),
                "raw_bytes": sum(o["raw_bytes"] for o in outs),
                "rank_payload_bytes": [o["payload_bytes"] for o in outs], "sharded": self.info}

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            ray.get([a.shutdown.remote() for a in self.ranks], timeout=60)
        finally:
            for a in self.ranks:
                ray.kill(a)
            remove_placement_group(self.pg)
