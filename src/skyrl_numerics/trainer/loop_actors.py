"""The RL loop's actors (``loop.py``): the engines, each configuration's trainer and the exact
on-policy reference, in process or as Ray actors.

:class:`LoopActors` starts what a configuration needs on demand — one engine per engine kind
(stock, invariant with a KV format, a seed recipe's serving numerics) or the server, one trainer
per configuration (``workers.TrainerWorker``, or a ``rank_group.TrainerGroup`` of rank actors) —
and on close puts the checkpoint's weights back into the engines (they may be shared, cached ones),
closes what it started and shuts down the Ray it started.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from skyrl_numerics.engine.weight_update import stock_reload_problem
from skyrl_numerics.errors import InputError
from skyrl_numerics.host import isa_mismatch
from skyrl_numerics.invariant import from_checkpoint
from skyrl_numerics.invariant.numerics import NumericsPlan
from skyrl_numerics.rollout import Rollout

from .invariant_trainer import onpolicy_gradient
from .rank_group import TrainerGroup
from .workers import GeneratorWorker, ReplicaGeneratorWorker, TrainerWorker


class OnPolicyReference:
    """The exact on-policy gradient of a batch at given served weights (one invariant model,
    weights loaded per call)."""

    def __init__(self, model_dir: str, kv_cache=None, numerics=None):
        self.model = from_checkpoint(model_dir, kv_cache=kv_cache, numerics=numerics)

    def gradient(self, served: dict, rollout: Rollout, rewards, use_support: bool) -> dict:
        self.model.load_named((k, v) for k, v in served.items() if k in self.model._names)
        return onpolicy_gradient(self.model, rollout, rewards, use_support=use_support)


def check_in_place_sync(model_dir, configs) -> None:
    """vLLM CPU 0.32 cannot reload an MLA model's weights in place (its layerwise reload fails in
    ``_copy_and_restore_kernel_tensors`` on the processed MLA weights), so a stock DeepSeek engine
    cannot follow the trainer; the invariant engine can. Refuse before anything starts."""
    on_gpu = torch.cuda.is_available()
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    stock = [c.name for c in configs if not c.invariant_engine]
    if cfg.get("kv_lora_rank") is not None and stock and not on_gpu:
        raise InputError(f"configs {stock} need the stock vLLM engine to take new weights in place, "
                         "which vLLM CPU 0.32 cannot do for MLA models (layerwise reload of the "
                         "processed MLA weights fails); run --configs bitwise for this family",
                         field="configs")
    arch = (cfg.get("architectures") or [None])[0]
    problem = stock_reload_problem(arch)
    if problem and stock:
        raise InputError(f"configs {stock} need the stock vLLM engine to take new weights in place, "
                         f"which vLLM CPU 0.32 does not do for {arch}: {problem}; run --configs "
                         "bitwise for this family", field="configs")


class LoopActors:
    """The loop's engines, trainers and references for one run (a :class:`~.loop.LoopRun`)."""

    def __init__(self, run):
        self.run, self.placement = run, run.placement
        self.use_ray = run.placement.use_ray
        self.started_ray = False
        if self.use_ray or run.placement.multi_rank:
            import ray

            if not ray.is_initialized():
                ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
                self.started_ray = True
        self.gens: dict = {}
        self.references: dict = {}
        self.trainer_host, self.engine_hosts = None, []

    def __enter__(self) -> "LoopActors":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- calls: direct, or through Ray ------------------------------------------------------------
    def call(self, obj, name: str, *args, **kwargs):
        """``obj.name(...)``; a Ray actor's method is submitted (a group's methods block and return
        values; the server's client, ``RemoteGeneratorWorker``, is in this process either way)."""
        method = getattr(obj, name)
        if self.use_ray and hasattr(method, "remote"):
            return method.remote(*args, **kwargs)
        return method(*args, **kwargs)

    def get(self, ref):
        if not self.use_ray:
            return ref
        import ray

        return ray.get(ref) if isinstance(ref, ray.ObjectRef) else ref

    def ask(self, obj, name: str, *args, **kwargs):
        """``call`` then ``get``: the answer."""
        return self.get(self.call(obj, name, *args, **kwargs))

    def _start(self, cls, *args, **kwargs):
        if not self.use_ray:
            return cls(*args, **kwargs)
        import ray

        return ray.remote(num_cpus=0)(cls).remote(*args, **kwargs)

    # ---- what a configuration needs ----------------------------------------------------------------
    def generator_for(self, cfg):
        """The engine of ``cfg``'s kind (started once per kind), or the server."""
        p = self.placement
        if p.server is not None:
            return self._server_for(cfg)
        key = (cfg.invariant_engine, cfg.kv_cache if cfg.invariant_engine else None, cfg.numerics)
        if key not in self.gens:
            if cfg.numerics is not None and p.replicas > 1:
                raise InputError("a recipe with --replicas: not wired", field="replicas")
            cls = ReplicaGeneratorWorker if p.replicas > 1 else GeneratorWorker
            args = (str(self.run.model_dir), *key[:2]) + ((p.replicas,) if p.replicas > 1 else ())
            kw = {"numerics": cfg.numerics} if cfg.numerics is not None else {}
            self.gens[key] = self._start(cls, *args, **kw)
        return self.gens[key]

    def _server_for(self, cfg):
        """The server's worker, refusing a configuration the server does not serve."""
        from skyrl_numerics.engine.remote import RemoteGeneratorWorker

        p = self.placement
        if "server" not in self.gens:
            self.gens["server"] = RemoteGeneratorWorker(p.server, api_key=p.api_key, model_dir=str(self.run.model_dir),
                                                        pause="keep" if self.run.settings.off_policy else None)
        gen = self.gens["server"]
        served = gen.gen
        if cfg.invariant_engine != served.batch_invariant:
            need = "a --batch-invariant server" if cfg.invariant_engine else "a stock server"
            raise InputError(f"config {cfg.name!r} needs {need}; {p.server} is "
                             f"{'batch-invariant' if served.batch_invariant else 'stock'}", field="configs")
        if cfg.numerics != NumericsPlan.from_json(served.numerics):     # the server's: JSON
            what = f"recipe {cfg.recipe!r}'s serving numerics" if cfg.recipe else "no recipe"
            raise InputError(f"config {cfg.name!r} needs {what}; {p.server} serves "
                             f"{'another plan' if served.numerics else 'none'} (start it with "
                             "skyrl-numerics serve --batch-invariant --recipe ...)", field="recipe")
        served_kv = (served.kv_cache or {}).get("format", "auto")
        if cfg.invariant_engine and served_kv != (cfg.kv_cache or "auto"):
            raise InputError(f"config {cfg.name!r} uses kv_cache {cfg.kv_cache!r}; the server "
                             f"stores {served_kv!r}", field="kv_cache")
        return gen

    def trainer_for(self, cfg, sync_dir: str):
        """``cfg``'s trainer: a group of rank actors (``--tp/--ep/--dp``), else one worker."""
        p = self.placement
        args = (str(self.run.model_dir), cfg, sync_dir, self.run.settings.snapshot_every)
        if p.multi_rank and not cfg.bitwise:
            return TrainerGroup(*args, backend=p.backend, tp=p.tp, ep=p.ep, dp=p.dp)
        return self._start(TrainerWorker, *args, p.backend)

    def reference_for(self, cfg) -> OnPolicyReference:
        """The exact on-policy gradient where the engine's numbers are (its KV format, its plan)."""
        key = (cfg.kv_cache if cfg.invariant_engine else None, cfg.numerics)
        if key not in self.references:
            self.references[key] = OnPolicyReference(str(self.run.model_dir), *key)
        return self.references[key]

    def meet(self, trn, gen) -> None:
        """Keep the trainer's host report (once) and each new engine's; warn once per engine whose
        ISA differs from the trainer's (bitwise trainer = engine holds only within one ISA)."""
        if self.trainer_host is None:
            self.trainer_host = self.ask(trn, "host_info")
        engine = self.ask(gen, "engine_host")
        if engine in self.engine_hosts:
            return
        self.engine_hosts.append(engine)
        warning = isa_mismatch(self.trainer_host, engine)
        if warning:
            logging.getLogger("skyrl_numerics.train").warning("%s", warning)

    def release(self, trn) -> None:
        """A configuration's trainer is done: close it (and its actor)."""
        self.ask(trn, "close")
        if self.use_ray and not isinstance(trn, TrainerGroup):
            import ray

            ray.kill(trn)

    def close(self) -> None:
        """The checkpoint's weights back into every engine; close what this run started."""
        for gen in self.gens.values():
            self.ask(gen, "restore")
        if self.use_ray:
            import ray

            for gen in self.gens.values():
                self.ask(gen, "close")
                if isinstance(gen, ray.actor.ActorHandle):   # not the server's client
                    ray.kill(gen)
        else:   # the further replicas' engines are this run's own; the cached one stays
            for gen in self.gens.values():
                if isinstance(gen, ReplicaGeneratorWorker):
                    gen.close(shared=False)
        if self.started_ray:  # leave the process as we found it
            import ray

            ray.shutdown()
