"""The RL loop's two workers (``trainer/loop.py``): :class:`GeneratorWorker` owns the vLLM engine
and applies each new weight version to it in place (a delta receiver, or the sharded transfer of a
multi-rank trainer); :class:`TrainerWorker` owns the policy, its optimizer and the publisher. Plain
classes; the loop makes them Ray actors with ``use_ray``, and ``rank_group.TrainerGroup`` runs one
``TrainerWorker`` per rank of a megatron trainer.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from skyrl_numerics.hf_config import moe_layout
from skyrl_numerics.invariant.multimodal import text_weights
from skyrl_numerics.rollout import Rollout

from .published import plain_names, published_trainer_kwargs


def has_routers(model_dir) -> bool:
    """Whether the checkpoint's ``config.json`` describes an MoE model (``hf_config.moe_layout``)."""
    with open(Path(model_dir) / "config.json") as f:
        return moe_layout(json.load(f)) is not None


class GeneratorWorker:
    """Owns the vLLM engine and a delta receiver; applies new versions to the engine in place."""

    def __init__(self, model_dir: str, batch_invariant: bool = False, kv_cache=None,
                 own_engine: bool = False, numerics=None):
        from skyrl_numerics.engine.generator import VLLMGenerator, get_generator

        self.model_dir = model_dir
        kw = dict(batch_invariant=True, kv_cache=kv_cache) if batch_invariant else {}
        if kv_cache is None:
            kw.pop("kv_cache", None)
        if numerics is not None:     # a recipe's serving numerics (a NumericsPlan; invariant engine only)
            # as JSON: what vLLM's worker processes receive, and the engine cache's key
            kw["numerics"] = numerics.to_json()
        self.initial_adapters = _initial_adapters(model_dir, numerics)
        # the process-wide cached engine, or (a further replica) an engine of its own; routes are
        # captured where the model has routers (a dense model has none to capture)
        self.gen = (VLLMGenerator if own_engine else get_generator)(
            model_dir, capture_routes=has_routers(model_dir), **kw)
        self.own_engine = own_engine
        self.receiver = None

    def restore(self) -> None:
        """Put the checkpoint's own weights back into the (possibly shared, cached) engine."""
        from safetensors.torch import load_file

        from skyrl_numerics.engine.weight_update import update_vllm_weights

        cfg = json.loads((Path(self.model_dir) / "config.json").read_text())
        own = text_weights(cfg, load_file(str(Path(self.model_dir) / "model.safetensors")))
        update_vllm_weights(self.gen, {**own, **self.initial_adapters})

    def close(self) -> None:
        """Shut the engine down (its worker processes would outlive a killed Ray actor)."""
        self.gen.close()

    def attach(self, sync_dir: str, sharded: dict | None = None) -> dict:
        """Follow a new publisher (a new configuration): load its full snapshot into the engine.
        ``sharded``: a multi-rank trainer's ``{root, spec, version}`` (``sync/sharded.py``): the
        engine's ranks read only their links."""
        from skyrl_numerics.sync.weight_sync import DeltaReceiver
        from skyrl_numerics.engine.weight_update import update_vllm_weights

        if sharded is not None:
            return self.sync(sharded)
        self.receiver = DeltaReceiver(sync_dir)
        applied = self.receiver.sync()
        # LoRA: adapters the new trainer does not publish start from the plan's values again
        up = update_vllm_weights(self.gen, {**self.initial_adapters, **self.receiver.state})
        return {"version": self.receiver.version, "versions": len(applied),
                "engine_update_s": up.total_s}

    def sync(self, sharded: dict | None = None) -> dict:
        from skyrl_numerics.engine.weight_update import update_vllm_weights

        if sharded is not None:
            from skyrl_numerics.engine.sharded_worker import sharded_update

            out = sharded_update(self.gen, sharded["root"], sharded["spec"], sharded["version"])
            return {"version": out["version"], "engine_update_s": out["prepare_s"] + out["commit_s"],
                    "engine_bytes_read": out["bytes_read"]}
        applied = self.receiver.sync()
        changed = sorted({n for m in applied for n in m.changed})
        up = update_vllm_weights(self.gen, self.receiver.state, changed=changed)
        return {"version": self.receiver.version, "engine_update_s": up.total_s,
                "engine_update_tensors": up.tensors,
                "payload_bytes": sum(m.payload_nbytes for m in applied),
                "raw_bytes": sum(m.raw_nbytes for m in applied)}

    def generate(self, prompts, **sampling) -> Rollout:
        return self.gen.generate(prompts, **sampling)

    def generate_multiturn(self, prompts, env, **sampling) -> Rollout:
        return self.gen.generate_multiturn(prompts, env, **sampling)

    def engine_host(self) -> dict | None:
        """The engine worker's host report, asked once at engine start (generator.py)."""
        return getattr(self.gen, "engine_host", None)

    def contract(self) -> dict:
        """The execution contract the engine's worker computes now (``to_dict``)."""
        return self.gen.contract().to_dict()


def _checkpoint_bf16_bytes(model_dir: str) -> int:
    """What a full weight sync sends raw: every checkpoint tensor, floating ones of 2 bytes or
    more in bf16 except float32 ones the model keeps in float32 (a router bias), from the
    headers."""
    import math

    from skyrl_numerics.safetensors_header import read_header
    from skyrl_numerics.invariant.base import checkpoint_files

    size = {"F32": 4, "F64": 2, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
            "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
    return sum(size.get(e["dtype"], 2) * math.prod(e["shape"]) for f in checkpoint_files(model_dir)
               for e in read_header(f, str(model_dir)).values())


def _initial_adapters(model_dir: str, plan) -> dict:
    """The starting adapters of a LoRA plan (a NumericsPlan: what the engine holds after start-up)."""
    if plan is None:
        return {}
    import json

    import torch

    from skyrl_numerics.invariant.numerics import init_adapter, plan_adapter_shapes

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return {n: init_adapter(n, shp, torch.bfloat16, plan.seed)
            for n, shp in plan_adapter_shapes(plan, cfg).items()}


class ReplicaGeneratorWorker:
    """``replicas`` engines behind :class:`~skyrl_numerics.engine.router.ReplicaRouter`
    (sticky sessions, least-loaded placement, each prompt keeps its seed), each with its own
    receiver: every version reaches every replica (the same methods as :class:`GeneratorWorker`;
    per-replica rows and tokens/s in the rollout's ``meta``)."""

    def __init__(self, model_dir: str, batch_invariant: bool = False, kv_cache=None, replicas: int = 2):
        from skyrl_numerics.engine.router import ReplicaRouter

        self.workers = []
        try:
            for i in range(replicas):
                self.workers.append(GeneratorWorker(model_dir, batch_invariant, kv_cache, own_engine=i > 0))
        except BaseException:
            self.close()
            raise
        self.router = ReplicaRouter([w.gen for w in self.workers])

    def restore(self) -> None:
        for w in self.workers:
            w.restore()

    def close(self, *, shared: bool = True) -> None:
        """Close every replica's engine (``shared=False``: only the ones this worker started)."""
        for w in self.workers:
            if shared or w.own_engine:
                w.close()

    def attach(self, sync_dir: str, sharded: dict | None = None) -> dict:
        return self._merge([w.attach(sync_dir, sharded) for w in self.workers])

    def sync(self, sharded: dict | None = None) -> dict:
        return self._merge([w.sync(sharded) for w in self.workers])

    @staticmethod
    def _merge(outs: list) -> dict:
        versions = {o["version"] for o in outs}
        if len(versions) != 1:   # pragma: no cover - every replica applies the same chain
            raise RuntimeError(f"replicas hold different versions {sorted(versions)}")
        out = dict(outs[0])
        out["engine_update_s"] = max(o["engine_update_s"] for o in outs)
        if "engine_bytes_read" in out:
            out["engine_bytes_read"] = {f"{i}/{r}": b for i, o in enumerate(outs)
                                        for r, b in o["engine_bytes_read"].items()}
        return out

    def generate(self, prompts, **sampling) -> Rollout:
        return self.router.generate(prompts, **sampling)

    def engine_host(self) -> dict | None:
        return self.workers[0].engine_host()

    def contract(self) -> dict:
        """Every replica's execution contract; replicas that differ are refused naming the
        fields (the first replica's stands for all)."""
        from skyrl_numerics.invariant.contract import ExecutionContract, check

        cs = [ExecutionContract.from_dict(w.contract()) for w in self.workers]
        for i, c in enumerate(cs[1:], 1):
            check(cs[0], c, what=f"engine replica {i} vs replica 0")
        return cs[0].to_dict()


class TrainerWorker:
    """Owns the policy (fp32 master weights), the optimizer and the delta publisher."""

    def __init__(self, model_dir: str, config, sync_dir: str, snapshot_every: int,
                 backend: str = "fsdp", tp: int = 1, ep: int = 1):
        """``config``: a :class:`~skyrl_numerics.trainer.loop.LoopConfig` (its ``trainer`` is the
        update's :class:`~skyrl_numerics.trainer.config.TrainerConfig`)."""
        self.model_dir = model_dir
        self.sharded = None   # a rank of a multi-rank trainer (rank_group.py): its ShardedPublisher
        self.bitwise = config.bitwise
        self.megatron = backend == "megatron" and not config.bitwise
        self.recipe = config.numerics is not None and not config.bitwise
        self.numerics, self.mode = config.numerics, config.trainer.batch_invariant
        self.trainer = self._build_trainer(config, tp, ep)
        # an FSDP2 rank of a data-parallel group: weights gathered to rank 0, which alone publishes
        self.fsdp_ranks = 1 if self.bitwise or self.megatron else self.trainer.world_size
        self.publisher = self._make_publisher(sync_dir, snapshot_every, tp, ep)
        self.publish(full=True)

    def _build_trainer(self, config, tp: int, ep: int):
        """The invariant trainer (bitwise), megatron-core, or FSDP over the HF model; a recipe's
        published trainer adds its plan's fake-quant rules and LoRA to the config's trainer."""
        if self.bitwise:
            from skyrl_numerics.trainer.invariant_trainer import InvariantTrainer

            return InvariantTrainer(self.model_dir, config.trainer, kv_cache=config.kv_cache,
                                    numerics=config.numerics)
        from skyrl_numerics.models import load_hf_model

        tcfg, hf = config.trainer, None
        if self.recipe:
            hf = load_hf_model(self.model_dir, dtype="float32")
            tcfg = dataclasses.replace(tcfg, **published_trainer_kwargs(config.numerics, hf))
            self.initial_adapters = _initial_adapters(self.model_dir, config.numerics)
        if self.megatron:  # megatron-core GPTModel; with tp x ep > 1 this is one rank of a group
            from skyrl_numerics.trainer.megatron.trainer import MegatronTrainer

            trainer = MegatronTrainer(self.model_dir, tcfg, tp=tp, ep=ep)
        else:
            from skyrl_numerics.trainer.fsdp.trainer import FSDPTrainer

            trainer = FSDPTrainer(hf if hf is not None else load_hf_model(self.model_dir, dtype="float32"), tcfg)
        trainer.keep_grads = True
        return trainer

    def _make_publisher(self, sync_dir: str, snapshot_every: int, tp: int, ep: int):
        """The delta publisher (None on a data-parallel rank other than 0); a multi-rank
        megatron trainer's rank gets a ShardedPublisher in ``self.sharded`` instead."""
        from skyrl_numerics.sync.weight_sync import DeltaPublisher

        if self.megatron and self.trainer.world_size > 1:
            from skyrl_numerics.sync import shard_layouts as sl
            from skyrl_numerics.sync import shard_plan as sp
            from skyrl_numerics.sync.sharded import ShardedPublisher

            c, w = self.trainer.hf_config, self.trainer.world_size
            plan = sp.plan(sl.megatron_layout(c, tp=tp, ep=ep, world=w), sl.vllm_layout(c, tp=1))
            self.sharded = ShardedPublisher(sync_dir, plan, snapshot_every=snapshot_every)
            return None
        if self.fsdp_ranks == 1 or self.trainer.rank == 0:
            return DeltaPublisher(sync_dir, snapshot_every=snapshot_every)
        return None

    def _served_state(self) -> dict:
        """The weights as the engine serves them: checkpoint names, bf16."""
        import torch

        from skyrl_numerics.engine.weight_update import checkpoint_state_dict

        if self.bitwise:
            return self.trainer.served_state()
        if self.megatron:  # gathered from the TP/EP shards, HF checkpoint names
            sd = self.trainer.full_state_dict()
            return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in sd.items()}
        if self.fsdp_ranks > 1:   # collective: gathered to rank 0 ({} elsewhere), checkpoint names
            sd = _revert_names(self.trainer.model, self.trainer.full_state_dict())
            return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in sd.items()}
        if self.recipe:          # plain names; with LoRA only the adapters (the base is frozen)
            sd = plain_names(dict(self.trainer.model.state_dict()))
            if self.trainer.lora_modules:   # every adapter the engine serves: any this trainer
                # has no layer for (a non-standard experts layout is refused) at the plan's start
                sd = {**self.initial_adapters, **{k: v for k, v in sd.items() if ".lora_" in k}}
            else:
                sd = _revert_names(self.trainer.model, sd)
            return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in sd.items()}
        sd = checkpoint_state_dict(self.trainer.model)
        return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in sd.items()}

    def served_state(self) -> dict:
        return self._served_state()

    def last_grads(self) -> dict:
        """The last step's gradient (before clipping) under checkpoint names, fp32."""
        if self.bitwise:
            return self.trainer.last_grads
        if self.megatron:
            return self.trainer.hf_grads()
        grads = self.trainer.last_grads
        if self.recipe:
            grads = plain_names(grads)
            return grads if self.trainer.lora_modules else _revert_names(self.trainer.model, grads)
        if self.fsdp_ranks > 1:   # collective: every rank gathers its DTensor shards, same order
            grads = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in grads.items()}
        return _revert_names(self.trainer.model, grads)

    def publish(self, full: bool = False) -> dict:
        if self.sharded is not None:   # this rank's links only; the group seals the version
            import torch

            shards = {k: v.detach().to(torch.bfloat16).contiguous()
                      for k, v in self.trainer.megatron_state_dict().items()}
            ms = list(self.sharded.publish(self.trainer.rank, shards, full=full).values())
            return {"version": ms[0].version if ms else None, "full": all(m.is_full for m in ms),
                    "changed": sum(len(m.changed) for m in ms),
                    "payload_bytes": sum(m.payload_nbytes for m in ms),
                    "raw_bytes": sum(m.raw_nbytes for m in ms)}
        state = self._served_state()     # collective on a data-parallel group
        if self.publisher is None:       # a data-parallel rank other than 0: rank 0 publishes
            return {"version": None}
        m = self.publisher.publish(state, full=full)
        out = {"version": m.version, "full": m.is_full, "changed": len(m.changed),
               "payload_bytes": m.payload_nbytes, "raw_bytes": m.raw_nbytes}
        if self.recipe or (self.bitwise and self.trainer.model.numerics is not None):
            out["full_model_bytes"] = _checkpoint_bf16_bytes(self.model_dir)   # a full sync's raw bytes
        return out

    def seal(self, version: int) -> dict:
        """(A group's rank 0) write the sharded version record once every rank has published."""
        self.sharded.seal(version)
        return {"root": self.sharded.root, "spec": self.sharded.spec, "version": int(version)}

    def sharded_info(self) -> dict | None:
        return None   # a single-rank trainer publishes whole tensors (DeltaPublisher)

    def logprobs(self, rollout: Rollout) -> np.ndarray:
        return self.trainer.logprobs(rollout)

    def last_logprobs(self) -> np.ndarray:
        """(The invariant trainer) the last update's forward logprobs, before its optimizer step."""
        return self.trainer.last_logprobs

    def host_info(self) -> dict:
        """Where the trainer runs (a Ray actor may sit on another machine): host.host_info."""
        from skyrl_numerics.host import host_info

        return host_info()

    def contract(self) -> dict:
        """The execution contract of this trainer's forward (``to_dict``): the invariant model's
        (bitwise), else the HF / megatron trainer's (its config, fp32, the recipe's plan, the
        mode when ``batch_invariant``) — recorded, compared only for bitwise configurations."""
        import json

        from skyrl_numerics.invariant import contract

        if self.bitwise:
            return contract.of_model(self.trainer.model).to_dict()
        cfg = json.loads((Path(self.model_dir) / "config.json").read_text())
        return contract.of_hf(cfg, dtype="float32", numerics=self.numerics, mode=self.mode).to_dict()

    def close(self) -> None:
        """Release what the trainer holds process-wide (the megatron trainer's process group)."""
        close = getattr(self.trainer, "close", None)
        if close is not None:
            close()

    def step(self, rollout: Rollout, rewards, old_logprobs) -> dict:
        return self.trainer.step(rollout, rewards, old_logprobs=old_logprobs)


def _revert_names(model, state: dict) -> dict:
    """``state`` (in-memory names of ``model``) under its checkpoint names (transformers >= 5
    fuses Qwen3-MoE experts in memory; see ``checkpoint_state_dict``)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return dict(state)
    return dict(revert_weight_conversion(model, dict(state)))
