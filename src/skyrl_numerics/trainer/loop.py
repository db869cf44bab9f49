"""The thin RL loop: vLLM generates, the trainer scores and updates, deltas flow back into vLLM.

One step of one configuration::

    rollout  = generator.generate(prompts, n=G)            # real vLLM; routes + support captured
    rewards  = task.reward(rollout)                        # verifiable: no model involved
    old_lp   = trainer.logprobs(rollout)                   # with this config's alignment pieces
    gap      = measure(old_lp, rollout.rollout_logprobs)   # mean |Δ|, F(2), KL k3 per step
    metrics  = trainer.step(rollout, rewards, old_logprobs=old_lp)   # GRPO, PPO-clip, correction
    manifest = publisher.publish(bf16 weights)             # XOR delta vs the last version, zstd
    receiver.sync(); update_vllm_weights(engine, ...)      # in place, no restart

Generator and trainer are :class:`GeneratorWorker` / :class:`TrainerWorker` (``workers.py``); with ``use_ray`` they
run as Ray actors on a local cluster and rollouts travel through the object store (numpy arrays
and packed routes come back as views of the shared buffer, not copies).

Configurations (``plain``, ``aligned``, ``bitwise``) run one after the other from the same
initial weights (the engine is reset by a full-snapshot sync), so their reward and gap curves
compare directly. ``bitwise`` is true on-policy RL: the invariant engine samples, the invariant
trainer (:class:`~skyrl_numerics.trainer.invariant_trainer.InvariantTrainer`) recomputes the same
logprobs bit for bit, updates, and syncs the new bf16 weights back.

With ``measure_grad`` every step also reports ``grad_cos_onpolicy`` / ``grad_relerr_onpolicy``:
the cosine and relative error of the configuration's gradient (before clipping) against the exact
on-policy gradient of the same batch at the same weights
(:func:`~skyrl_numerics.trainer.invariant_trainer.onpolicy_gradient`) — the bias the remaining causes
put into the update, measured directly (``bitwise``: 1 and 0 by construction).
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from skyrl_numerics.invariant.numerics import NumericsPlan
from skyrl_numerics.rollout import Rollout
from skyrl_numerics.trainer.config import TrainerConfig
from skyrl_numerics.trainer.loop_report import step_metrics
from skyrl_numerics.trainer.workers import GeneratorWorker, TrainerWorker


# ---- the task ------------------------------------------------------------------------------
@dataclass(frozen=True)
class TargetSetTask:
    """Verifiable toy task: reward = share of response tokens whose id is below ``limit``.

    A random tiny model hits it ``limit / vocab`` of the time (12.5 % for 64 / 512); a policy that
    learns moves its mass into the set, so the reward climbs within a few CPU steps.
    """
    limit: int = 64

    def reward(self, rollout: Rollout) -> np.ndarray:
        hit = (rollout.response_tokens < self.limit).astype(np.float64)
        lens = rollout.response_lens
        seq = np.repeat(np.arange(len(lens)), lens)
        sums = np.bincount(seq, weights=hit, minlength=len(lens))
        return np.where(lens > 0, sums / np.maximum(lens, 1), 0.0)


@dataclass(frozen=True)
class EnvRewardTask:
    """Multi-turn: each trajectory's reward is the sum of its environment's step rewards
    (``generate_multiturn`` puts them in ``meta["env_reward"]``)."""
    name: str = "env"

    def reward(self, rollout: Rollout) -> np.ndarray:
        return np.asarray(rollout.meta["env_reward"], dtype=np.float64)


# ---- configurations ------------------------------------------------------------------------
@dataclass
class LoopConfig:
    """One configuration of the loop: its trainer (every number of the update, the alignment
    pieces) and the engine its rollouts come from."""
    name: str = "plain"
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    bitwise: bool = False                  # invariant engine + invariant trainer
    kv_cache: str | None = None            # invariant engine: the cache format (bitwise: both sides)
    # a seed recipe (trainer/seed_recipes.py): its name and its serving numerics. The invariant
    # engine serves them; bitwise: the invariant trainer computes the same, published: the HF
    # trainer fake-quantizes (apply_qat) and carries LoRA on its linears
    recipe: str | None = None
    numerics: NumericsPlan | None = None

    @property
    def invariant_engine(self) -> bool:
        return self.bitwise or self.numerics is not None


CONFIGS = {
    "plain": LoopConfig("plain"),
    "aligned": LoopConfig("aligned", TrainerConfig(route_replay=True, use_support=True, correction="token_tis",
                                                   correction_kwargs={"cap": 2.0})),
    "bitwise": LoopConfig("bitwise", TrainerConfig(use_support=True), bitwise=True),
}


@dataclass
class LoopSettings:
    steps: int = 5
    prompts_per_step: int = 4
    samples_per_prompt: int = 4
    prompt_len: int = 8
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 0.9
    top_k: int = 16
    seed: int = 0
    snapshot_every: int = 10
    # 0: on-policy (each rollout uses the weights of the step before). 1: the next rollout is
    # generated while the trainer updates (with Ray, concurrently), so it lags one version —
    # the asynchronous setup where off-policy corrections earn their keep.
    off_policy: int = 0
    # cosine / relative error of each config's gradient against the exact on-policy gradient
    measure_grad: bool = True
    # > 1: multi-turn trajectories of up to this many model turns (generate_multiturn with the
    # run's environment; max_tokens per turn); the loss, gap and corrections see model tokens only
    turns: int = 1


def _check_in_place_sync(model_dir, configs) -> None:
    """vLLM CPU 0.32 cannot reload an MLA model's weights in place (its layerwise reload fails in
    ``_copy_and_restore_kernel_tensors`` on the processed MLA weights), so a stock DeepSeek engine
    cannot follow the trainer; the invariant engine can. Refuse before anything starts."""
    import json

    from skyrl_numerics.errors import InputError

    try:
        import torch

        on_gpu = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        on_gpu = False
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    stock = [c.name for c in configs if not c.invariant_engine]
    if cfg.get("kv_lora_rank") is not None and stock and not on_gpu:
        raise InputError(f"configs {stock} need the stock vLLM engine to take new weights in place, "
                         "which vLLM CPU 0.32 cannot do for MLA models (layerwise reload of the "
                         "processed MLA weights fails); run --configs bitwise for this family",
                         field="configs")


class OnPolicyReference:
    """The exact on-policy gradient of a batch at given served weights (one invariant model,
    weights loaded per call)."""

    def __init__(self, model_dir: str, kv_cache=None, numerics=None):
        from skyrl_numerics.invariant import from_checkpoint

        self.model = from_checkpoint(model_dir, kv_cache=kv_cache, numerics=numerics)

    def gradient(self, served: dict, rollout: Rollout, rewards, use_support: bool) -> dict:
        from skyrl_numerics.trainer.invariant_trainer import onpolicy_gradient

        self.model.load_named((k, v) for k, v in served.items() if k in self.model._names)
        return onpolicy_gradient(self.model, rollout, rewards, use_support=use_support)


# ---- the loop --------------------------------------------------------------------------------
@dataclass
class LoopResult:
    settings: dict
    history: dict[str, list[dict]]     # config name -> per-step metrics
    # host (the trainer's), engine_host, isa_mismatch, isa_warning (skyrl_numerics.host.host_report)
    host: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"settings": self.settings, "history": self.history, **self.host}


def _remote(cls, use_ray: bool):
    if not use_ray:
        return cls, (lambda ref: ref)
    import ray

    return ray.remote(num_cpus=0)(cls), ray.get


def run_loop(model_dir: str, configs: list[LoopConfig], settings: LoopSettings | None = None, *,
             task=None, use_ray: bool = False, work_dir=None,
             progress: bool = True, backend: str = "fsdp", server=None,
             api_key: str | None = None, tp: int = 1, ep: int = 1, replicas: int = 1,
             dp: int = 1, env=None) -> LoopResult:
    """Run ``settings.steps`` GRPO steps for each configuration; return per-step metrics.
    The engine gets the checkpoint's weights back at the end (it may be a shared, cached one).
    ``settings.off_policy = 1`` overlaps generation of step s+1 with the update of step s.
    ``backend``: the trainer of the non-bitwise configurations, ``"fsdp"`` (HF model) or ``"megatron"``
    (megatron-core GPTModel, :class:`~skyrl_numerics.trainer.megatron.trainer.MegatronTrainer`).
    ``server``: the URL of a running ``vllm serve`` (``skyrl-numerics serve``), or a list of
    URLs (replicas behind :class:`~skyrl_numerics.engine.router.ReplicaRouter`: sticky,
    least-loaded; per-replica ``replica_gap_*`` / ``replica_tokens_per_s`` in each step), to generate with
    instead of an in-process engine; each step's weights reach it through vLLM's own HTTP client
    and the ``skyrl_delta`` backend (:class:`~skyrl_numerics.engine.remote.RemoteGeneratorWorker`;
    ``off_policy`` pauses it with ``mode=keep`` around each update). The ``bitwise`` config needs a
    ``--batch-invariant`` server, the others a stock one.
    ``tp`` / ``ep`` (megatron backend): the plain/aligned trainer runs on ``max(tp, ep)`` ranks as
    Ray actors (:class:`~skyrl_numerics.trainer.rank_group.TrainerGroup`) and reaches the in-process
    engine by sharded transfer (``sync/sharded.py``); per step ``sync_rank_payload_bytes`` (what each
    trainer rank sent) and ``engine_bytes_read``. ``dp`` (fsdp backend): an FSDP2 data-parallel
    trainer on ``dp`` rank actors; rank 0 publishes the gathered weights. ``replicas``: in-process engines behind a
    ``ReplicaRouter`` (:class:`~skyrl_numerics.trainer.workers.ReplicaGeneratorWorker`), every
    version applied to each; per-replica ``replica_gap_*`` / ``replica_tokens_per_s`` per step.
    ``settings.turns > 1``: multi-turn trajectories through ``env`` (an environment factory,
    ``engine/multiturn.py``; default the toy ``KeyValueEnv``), routes as turn deltas,
    the task's default the environment's reward; per step ``gap_per_turn_max_abs`` /
    ``gap_per_turn_mean_abs`` (by turn index) and ``route_bytes_delta`` / ``route_bytes_full``."""
    from rich.progress import Progress

    from skyrl_numerics.rollout.prompts import make_prompts
    from skyrl_numerics.gap import measure

    s = settings or LoopSettings()
    multi_turn = s.turns > 1
    if s.turns < 1:
        from skyrl_numerics.errors import InputError

        raise InputError(f"turns must be >= 1, got {s.turns}", field="turns")
    if multi_turn and replicas > 1:
        from skyrl_numerics.errors import InputError

        raise InputError("multi-turn with in-process replicas: not wired (each turn must reach "
                         "the replica holding the history's KV)", field="replicas")
    if multi_turn and env is None:
        from skyrl_numerics.engine.multiturn import KeyValueEnv

        env = KeyValueEnv
    task = task or (EnvRewardTask() if multi_turn else TargetSetTask())
    if backend not in ("fsdp", "megatron"):
        from skyrl_numerics.errors import InputError

        raise InputError(f"unknown backend {backend!r}; expected 'fsdp' or 'megatron'", field="backend")
    if tp < 1 or ep < 1 or (backend != "megatron" and tp * ep > 1):
        from skyrl_numerics.errors import InputError

        raise InputError(f"tp={tp}, ep={ep}: a multi-rank trainer needs the megatron backend and "
                         "tp, ep >= 1", field="tp" if tp != 1 else "ep")
    if dp < 1 or (backend != "fsdp" and dp > 1):
        from skyrl_numerics.errors import InputError

        raise InputError(f"dp={dp}: data parallel ranks are the fsdp backend's, dp >= 1", field="dp")
    if backend == "megatron" and any(not c.bitwise for c in configs):
        from skyrl_numerics.trainer.megatron.model import check_parallel_config

        check_parallel_config(model_dir, tp, ep)  # the family must be mapped, before any engine starts
    multi = (backend == "megatron" and tp * ep > 1) or dp > 1
    if replicas < 1 or (replicas > 1 and server is not None):
        from skyrl_numerics.errors import InputError

        raise InputError(f"replicas={replicas}: in-process replicas need replicas >= 1 and no server "
                         "(several servers: pass their URLs)", field="replicas")
    if multi and server is not None:
        from skyrl_numerics.errors import InputError

        raise InputError("a multi-rank trainer (--tp/--ep/--dp) with --server: not wired; it feeds in-process engines",
                         field="server")
    if server is None:
        _check_in_place_sync(model_dir, configs)
    # absolute: Ray actors do not share the driver's working directory
    work = Path(work_dir or tempfile.mkdtemp(prefix="skyrl_loop_")).resolve()
    started_ray = False
    if use_ray or multi:
        import ray

        if not ray.is_initialized():
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            started_ray = True
    from skyrl_numerics.trainer.workers import ReplicaGeneratorWorker

    Gen, get = _remote(ReplicaGeneratorWorker if replicas > 1 else GeneratorWorker, use_ray)
    Trn, _ = _remote(TrainerWorker, use_ray)
    from skyrl_numerics.trainer.rank_group import TrainerGroup

    def call(obj, name, *a, **k):
        if use_ray and not isinstance(obj, TrainerGroup):   # a group's methods block and return values
            return getattr(obj, name).remote(*a, **k)
        return getattr(obj, name)(*a, **k)

    if use_ray:
        import ray

        get = (lambda x: ray.get(x) if isinstance(x, ray.ObjectRef) else x)
    gens: dict = {}

    def generator_for(cfg):
        key = (cfg.invariant_engine, cfg.kv_cache if cfg.invariant_engine else None, cfg.numerics)
        if server is not None:
            return remote_for(cfg)
        if key not in gens:
            if cfg.numerics is not None and replicas > 1:
                from skyrl_numerics.errors import InputError

                raise InputError("a recipe with --replicas: not wired", field="replicas")
            args = (str(model_dir), *key[:2]) + ((replicas,) if replicas > 1 else ())
            kw = {"numerics": cfg.numerics} if cfg.numerics is not None else {}
            gens[key] = Gen.remote(*args, **kw) if use_ray else Gen(*args, **kw)
        return gens[key]
    def remote_for(cfg):
        from skyrl_numerics.errors import InputError
        from skyrl_numerics.engine.remote import RemoteGeneratorWorker

        if "server" not in gens:
            gens["server"] = RemoteGeneratorWorker(server, api_key=api_key, model_dir=str(model_dir),
                                                   pause="keep" if s.off_policy else None)
        gen = gens["server"]
        if cfg.invariant_engine != gen.gen.batch_invariant:
            need = "a --batch-invariant server" if cfg.invariant_engine else "a stock server"
            raise InputError(f"config {cfg.name!r} needs {need}; {server} is "
                             f"{'batch-invariant' if gen.gen.batch_invariant else 'stock'}",
                             field="configs")
        if cfg.numerics != NumericsPlan.from_json(gen.gen.numerics):     # the server's: JSON
            what = f"recipe {cfg.recipe!r}'s serving numerics" if cfg.recipe else "no recipe"
            raise InputError(f"config {cfg.name!r} needs {what}; {server} serves "
                             f"{'another plan' if gen.gen.numerics else 'none'} (start it with "
                             "skyrl-numerics serve --batch-invariant --recipe ...)", field="recipe")
        served_kv = (gen.gen.kv_cache or {}).get("format", "auto")
        if cfg.invariant_engine and served_kv != (cfg.kv_cache or "auto"):
            raise InputError(f"config {cfg.name!r} uses kv_cache {cfg.kv_cache!r}; the server "
                             f"stores {served_kv!r}", field="kv_cache")
        return gen
    references: dict = {}

    def reference_for(cfg):   # the exact on-policy gradient where the engine's numbers are
        key = (cfg.kv_cache if cfg.invariant_engine else None, cfg.numerics)
        if key not in references:
            references[key] = OnPolicyReference(str(model_dir), *key)
        return references[key]
    truncated = s.top_k > 1 or s.top_p < 1.0
    history: dict[str, list[dict]] = {}
    trainer_host, engine_hosts = None, []
    sampling = dict(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                    max_tokens=s.max_tokens, n=s.samples_per_prompt,
                    capture_support=s.top_k > 1)
    try:
        with Progress(disable=not progress) as prog:
            for cfg in configs:
                task_id = prog.add_task(f"{cfg.name}", total=s.steps)
                sync_dir = str(work / f"sync-{cfg.name}")
                args = (str(model_dir), cfg, sync_dir, s.snapshot_every, backend)
                if multi and not cfg.bitwise:
                    trn = TrainerGroup(*args[:4], backend=backend, tp=tp, ep=ep, dp=dp)
                else:
                    trn = Trn.remote(*args) if use_ray else Trn(*args)
                gen = generator_for(cfg)
                if trainer_host is None:
                    trainer_host = get(call(trn, "host_info"))
                _check_isa(trainer_host, get(call(gen, "engine_host")), engine_hosts)
                sharded = get(call(trn, "sharded_info"))   # a multi-rank trainer's store, else None
                get(call(gen, "attach", sync_dir, *([sharded] if sharded else [])))
                rows = history[cfg.name] = []

                gen_s: dict = {}

                def launch(step):     # (in process: the generation itself; with Ray: queued)
                    t = time.perf_counter()
                    try:
                        return _launch(step)
                    finally:
                        gen_s["launch"] = gen_s.get("launch", 0.0) + time.perf_counter() - t

                def _launch(step):
                    prompts = make_prompts(s.prompts_per_step, s.prompt_len, 512, s.seed + step)
                    if multi_turn:
                        return call(gen, "generate_multiturn", prompts, env, max_turns=s.turns,
                                    seed=s.seed + 100_000 * step, **sampling)
                    return call(gen, "generate", prompts, seed=s.seed + 1000 * step, **sampling)

                pending = launch(0)
                for step in range(s.steps):
                    ro_ref = pending
                    if s.off_policy and step + 1 < s.steps:
                        # queued on the generator before this step's sync: it samples with the
                        # current (soon stale) weights while the trainer works
                        pending = launch(step + 1)
                    t_gen = time.perf_counter()
                    rollout = get(ro_ref)
                    t_gen = time.perf_counter() - t_gen + gen_s.pop("launch", 0.0)
                    rewards = task.reward(rollout)
                    t_train = time.perf_counter()
                    old = get(call(trn, "logprobs", ro_ref if use_ray else rollout))
                    turn_kw = ({"mask": rollout.loss_mask, "turns": rollout.turns}
                               if rollout.is_multi_turn else {})
                    g = measure(old, rollout.rollout_logprobs, cu_seqlens=rollout.response_cu,
                                **turn_kw)
                    ref_grad = None
                    if s.measure_grad:   # at the weights before this update (not timed)
                        t_ref = time.perf_counter()
                        ref_grad = reference_for(cfg).gradient(get(call(trn, "served_state")),
                                                               rollout, rewards, use_support=truncated)
                        t_train -= time.perf_counter() - t_ref
                    m = get(call(trn, "step", ro_ref if use_ray else rollout, rewards, old))
                    t_train = time.perf_counter() - t_train
                    t_sync = time.perf_counter()
                    if ref_grad is not None:
                        from skyrl_numerics.trainer.invariant_trainer import compare_gradients

                        m = {**m, **compare_gradients(get(call(trn, "last_grads")), ref_grad)}
                    pub = get(call(trn, "publish"))
                    syn = get(call(gen, "sync", *([pub["sharded"]] if pub.get("sharded") else [])))
                    t_sync = time.perf_counter() - t_sync
                    if not s.off_policy and step + 1 < s.steps:
                        pending = launch(step + 1)
                    summ = g.summary()
                    rows.append({"step": step, "reward": float(rewards.mean()),
                                 "rollout_lag": s.off_policy if step else 0,
                                 "gap_mean_abs": summ["mean_abs"], "gap_max_abs": summ["max_abs"],
                                 "gap_frac_bitwise_equal": summ["frac_bitwise_equal"],
                                 "gap_F2": summ["F_2"],
                                 "gap_kl_k3": summ["kl_k3"], "loss": m["loss"],
                                 "clipfrac": m["clipfrac"], "entropy": m["entropy"],
                                 **{k: v for k, v in m.items() if k.startswith("correction/")
                                    or k.startswith("grad_")},
                                 "sync_version": pub["version"], "sync_payload_bytes": pub["payload_bytes"],
                                 "sync_raw_bytes": pub["raw_bytes"],
                                 "engine_update_s": syn["engine_update_s"],
                                 **({"sync_rank_payload_bytes": pub["rank_payload_bytes"],
                                     "engine_bytes_read": sum(syn["engine_bytes_read"].values())}
                                    if "sharded" in pub else {}),
                                 "time_generate_s": t_gen, "time_train_s": t_train,
                                 "time_sync_s": t_sync,
                                 **({"sync_full_model_bytes": pub["full_model_bytes"]}
                                    if "full_model_bytes" in pub else {}),
                                 **step_metrics(cfg, old, rollout, g)})
                    prog.update(task_id, advance=1, description=(
                        f"{cfg.name}: step {step} reward {rows[-1]['reward']:.3f} "
                        f"|Δ| {summ['mean_abs']:.2e} sync {pub['payload_bytes'] / 1e3:.0f} kB"))
                get(call(trn, "close"))
                if use_ray and not isinstance(trn, TrainerGroup):
                    import ray

                    ray.kill(trn)
    finally:
        for gen in gens.values():
            get(call(gen, "restore"))
        if use_ray:
            import ray

            for gen in gens.values():
                get(call(gen, "close"))
                ray.kill(gen)
        else:   # the further replicas' engines are this run's own; the cached one stays
            for gen in gens.values():
                if isinstance(gen, ReplicaGeneratorWorker):
                    gen.close(shared=False)
        if started_ray:  # leave the process as we found it
            import ray

            ray.shutdown()
    from skyrl_numerics.host import host_report

    task_desc = (asdict(task) if isinstance(task, TargetSetTask)
                 else {"reward": getattr(task, "name", repr(task))})
    if multi_turn:
        task_desc["env"] = getattr(env, "__name__", repr(env))
    return LoopResult(settings={**asdict(s), "task": task_desc, "use_ray": use_ray, "backend": backend,
                                "tp": tp, "ep": ep, "dp": dp, "replicas": replicas,
                                "configs": [asdict(c) for c in configs]}, history=history,
                      host=host_report(trainer_host, engine_hosts))


def _check_isa(trainer: dict, engine: dict | None, seen: list) -> None:
    """Keep each new engine's host report; warn once per engine whose ISA differs from the
    trainer's (bitwise trainer = engine holds only within one ISA)."""
    if engine in seen:
        return
    seen.append(engine)
    from skyrl_numerics.host import isa_mismatch

    warning = isa_mismatch(trainer, engine)
    if warning:
        import logging

        logging.getLogger("skyrl_numerics.train").warning("%s", warning)
