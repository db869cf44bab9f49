"""The thin RL loop: vLLM generates, the trainer scores and updates, deltas flow back into vLLM.

One step of one configuration::

    rollout  = generator.generate(prompts, n=G)            # real vLLM; routes + support captured
    rewards  = task.reward(rollout)                        # verifiable: no model involved
    old_lp   = trainer.logprobs(rollout)                   # with this config's alignment pieces
                                                           # (bitwise: the engine's, checked)
    metrics  = trainer.step(rollout, rewards, old_logprobs=old_lp)   # GRPO, PPO-clip, correction
    gap      = measure(old_lp, rollout.rollout_logprobs)   # mean |Δ|, F(2), KL k3 per step
    manifest = publisher.publish(bf16 weights)             # XOR delta vs the last version, zstd
    receiver.sync(); update_vllm_weights(engine, ...)      # in place, no restart

Each step's row times the four parts: ``time_generate_s``, ``time_old_logprobs_s`` (the
recompute), ``time_train_s`` (the update: forward + backward + optimizer) and ``time_sync_s``
(publish + the engine's in-place update); the on-policy reference gradient is in none of them.

A run is a :class:`LoopRun` (the configurations, :class:`LoopSettings`, :class:`LoopPlacement`,
the task); :func:`run_loop` composes named steps: :func:`prepare` (defaults, every refusal),
:class:`~skyrl_numerics.trainer.loop_actors.LoopActors` (the engines, trainers and on-policy
references), :class:`ConfigRun` per configuration (per step ``collect`` -> ``old_logprobs`` ->
``reference_gradient`` -> the trainer's ``step`` -> ``trainer_logprobs`` -> ``gap`` -> ``sync`` ->
:func:`record`), :func:`result`.
Generator and trainer are ``workers.GeneratorWorker`` / ``workers.TrainerWorker``; with
``use_ray`` they run as Ray actors on a local cluster and rollouts travel through the object store
(numpy arrays and packed routes come back as views of the shared buffer, not copies).

Before a configuration's first step and at every weight sync (before the engine takes the new
version) the trainer's and the engine's execution contracts are compared
(:mod:`~skyrl_numerics.trainer.loop_contract`): a ``bitwise`` configuration refuses a difference
naming the fields; every configuration records both in ``train.json`` → ``contracts``.

Configurations (``plain``, ``aligned``, ``bitwise``) run one after the other from the same
initial weights (the engine is reset by a full-snapshot sync), so their reward and gap curves
compare directly. ``bitwise`` is true on-policy RL: the invariant engine samples, the invariant
trainer (:class:`~skyrl_numerics.trainer.invariant_trainer.InvariantTrainer`) computes the same
logprobs bit for bit, updates, and syncs the new bf16 weights back. Its old logprobs are the
engine's, without a second forward; every ``recompute_old_every`` steps (and at step 0) the
trainer recomputes them and they must match bit for bit, and every step the update's own forward
must (:mod:`~skyrl_numerics.trainer.old_logprobs`; a difference raises naming step, sequence and
token). The row's ``old_logprobs_recomputed`` says which steps recomputed.

With ``measure_grad`` every step also reports ``grad_cos_onpolicy`` / ``grad_relerr_onpolicy``:
the cosine and relative error of the configuration's gradient (before clipping) against the exact
on-policy gradient of the same batch at the same weights
(:func:`~skyrl_numerics.trainer.invariant_trainer.onpolicy_gradient`) — the bias the remaining causes
put into the update, measured directly (``bitwise``: 1 and 0 by construction).
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.progress import Progress

from skyrl_numerics.errors import InputError
from skyrl_numerics.gap import measure
from skyrl_numerics.host import host_report
from skyrl_numerics.invariant.numerics import NumericsPlan
from skyrl_numerics.rollout import Rollout
from skyrl_numerics.rollout.prompts import make_prompts
from skyrl_numerics.trainer.config import TrainerConfig
from skyrl_numerics.trainer.invariant_trainer import compare_gradients
from skyrl_numerics.trainer.loop_actors import LoopActors, check_in_place_sync
from skyrl_numerics.trainer.loop_contract import ContractWatch
from skyrl_numerics.trainer.workers import has_routers
from skyrl_numerics.trainer.loop_report import step_metrics
from skyrl_numerics.trainer.old_logprobs import (RECOMPUTE_OLD_EVERY, check_bitwise, engine_old_logprobs,
                                                 recompute_due)
from skyrl_numerics.trainer.megatron.model import check_parallel_config


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
    # bitwise: the engine's logprobs are the old logprobs (no second forward); every this many
    # steps, and at step 0, the trainer recomputes them and they must match bit for bit
    # (trainer/old_logprobs.py). The other configurations recompute every step.
    recompute_old_every: int = RECOMPUTE_OLD_EVERY

    def __post_init__(self):
        if not (isinstance(self.recompute_old_every, int) and self.recompute_old_every >= 1):
            raise InputError(f"recompute_old_every must be an integer >= 1, got {self.recompute_old_every!r}",
                             field="recompute_old_every")

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
    """The run's schedule and sampling (every configuration the same)."""
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

    def sampling(self) -> dict:
        """The engine's sampling arguments of every request."""
        return dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                    max_tokens=self.max_tokens, n=self.samples_per_prompt, capture_support=self.top_k > 1)

    @property
    def truncated(self) -> bool:
        """Top-p / top-k sampling: the on-policy distribution is renormalized over the support."""
        return self.top_k > 1 or self.top_p < 1.0


@dataclass
class LoopPlacement:
    """Where the loop runs. ``backend``: the trainer of the non-bitwise configurations, ``"fsdp"``
    (HF model) or ``"megatron"`` (megatron-core GPTModel); ``tp`` / ``ep`` (megatron): that trainer
    on ``max(tp, ep)`` rank actors reaching the in-process engine by sharded transfer; ``dp``
    (fsdp): an FSDP2 data-parallel trainer on ``dp`` rank actors (rank 0 publishes); ``replicas``:
    in-process engines behind a ``ReplicaRouter``; ``server``: the URL (or URLs: replicas) of a
    running ``vllm serve`` (``skyrl-numerics serve``) to generate with, synced through vLLM's own
    HTTP client and the ``skyrl_delta`` backend (``bitwise`` needs a ``--batch-invariant`` server,
    the others a stock one); ``use_ray``: generator and trainer as Ray actors."""
    backend: str = "fsdp"
    tp: int = 1
    ep: int = 1
    dp: int = 1
    replicas: int = 1
    use_ray: bool = False
    server: str | list | None = None
    api_key: str | None = None

    @property
    def multi_rank(self) -> bool:
        return (self.backend == "megatron" and self.tp * self.ep > 1) or self.dp > 1

    def check(self, turns: int) -> None:
        """What cannot run together, refused naming the field."""
        if turns > 1 and self.replicas > 1:
            raise InputError("multi-turn with in-process replicas: not wired (each turn must reach "
                             "the replica holding the history's KV)", field="replicas")
        if self.backend not in ("fsdp", "megatron"):
            raise InputError(f"unknown backend {self.backend!r}; expected 'fsdp' or 'megatron'", field="backend")
        if self.tp < 1 or self.ep < 1 or (self.backend != "megatron" and self.tp * self.ep > 1):
            raise InputError(f"tp={self.tp}, ep={self.ep}: a multi-rank trainer needs the megatron backend "
                             "and tp, ep >= 1", field="tp" if self.tp != 1 else "ep")
        if self.dp < 1 or (self.backend != "fsdp" and self.dp > 1):
            raise InputError(f"dp={self.dp}: data parallel ranks are the fsdp backend's, dp >= 1", field="dp")


@dataclass
class LoopRun:
    """One run of the loop: the checkpoint, the configurations, the schedule, the placement, the
    task (default: :class:`TargetSetTask`; multi-turn: the environment's reward) and the
    environment (multi-turn; default the toy ``KeyValueEnv``)."""
    model_dir: str
    configs: list
    settings: LoopSettings = field(default_factory=LoopSettings)
    placement: LoopPlacement = field(default_factory=LoopPlacement)
    task: Any = None
    env: Any = None
    work_dir: str | os.PathLike | None = None
    progress: bool = True


@dataclass
class LoopResult:
    settings: dict
    history: dict[str, list[dict]]     # config name -> per-step metrics
    # host (the trainer's), engine_host, isa_mismatch, isa_warning (skyrl_numerics.host.host_report)
    host: dict = field(default_factory=dict)
    # config name -> its execution contracts (loop_contract.ContractWatch.record)
    contracts: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"settings": self.settings, "history": self.history, **self.host,
                "contracts": self.contracts}


# ---- the loop --------------------------------------------------------------------------------
def run_loop(run, configs=None, settings: LoopSettings | None = None, *, task=None, env=None,
             work_dir=None, progress: bool = True, **placement) -> LoopResult:
    """Run ``settings.steps`` GRPO steps for each configuration; return per-step metrics.

    ``run``: a :class:`LoopRun`; or, the older spelling, the checkpoint directory with the
    configurations, the :class:`LoopSettings` and :class:`LoopPlacement`'s fields as keywords.
    The engines get the checkpoint's weights back at the end (they may be shared, cached ones).
    ``settings.off_policy = 1`` overlaps generation of step s+1 with the update of step s.
    Per step (:func:`record`): the gap, the update's metrics, the sync's bytes and times; per
    engine replica ``replica_gap_*`` / ``replica_tokens_per_s``; with a multi-rank megatron trainer
    ``sync_rank_payload_bytes`` and ``engine_bytes_read``; multi-turn ``gap_per_turn_*`` and
    ``route_bytes_*``."""
    if not isinstance(run, LoopRun):
        run = LoopRun(run, list(configs), settings or LoopSettings(), LoopPlacement(**placement),
                      task=task, env=env, work_dir=work_dir, progress=progress)
    run = prepare(run)
    work = Path(run.work_dir or tempfile.mkdtemp(prefix="skyrl_loop_")).resolve()   # absolute: Ray
    history: dict[str, list[dict]] = {}
    contracts: dict[str, dict] = {}
    with LoopActors(run) as actors, Progress(disable=not run.progress) as prog:
        for cfg in run.configs:
            cr = ConfigRun(actors, run, cfg, work / f"sync-{cfg.name}")
            history[cfg.name] = cr.steps(prog)
            contracts[cfg.name] = cr.contract.record()
    out = result(run, history, actors)
    out.contracts = contracts
    return out


def prepare(run: LoopRun) -> LoopRun:
    """``run`` with its defaults filled in, checked before anything starts."""
    s, p = run.settings, run.placement
    if s.turns < 1:
        raise InputError(f"turns must be >= 1, got {s.turns}", field="turns")
    p.check(s.turns)
    env = run.env
    if s.turns > 1 and env is None:
        from skyrl_numerics.engine.multiturn import KeyValueEnv

        env = KeyValueEnv
    task = run.task or (EnvRewardTask() if s.turns > 1 else TargetSetTask())
    if p.backend == "megatron" and any(not c.bitwise for c in run.configs):
        check_parallel_config(run.model_dir, p.tp, p.ep)  # the family must be mapped, before any engine starts
    if p.replicas < 1 or (p.replicas > 1 and p.server is not None):
        raise InputError(f"replicas={p.replicas}: in-process replicas need replicas >= 1 and no server "
                         "(several servers: pass their URLs)", field="replicas")
    if p.multi_rank and p.server is not None:
        raise InputError("a multi-rank trainer (--tp/--ep/--dp) with --server: not wired; it feeds "
                         "in-process engines", field="server")
    if p.server is None:
        check_in_place_sync(run.model_dir, run.configs)
    return dataclasses.replace(run, task=task, env=env, configs=without_r3_on_dense(run))


def without_r3_on_dense(run: LoopRun) -> list:
    """The configurations, with router replay off where the checkpoint has no routers (a dense
    model: ``aligned`` is then support replay + TIS; the engine captures no routes for it, and
    ``train.json`` records ``route_replay: false``)."""
    if has_routers(run.model_dir):
        return list(run.configs)
    return [dataclasses.replace(c, trainer=dataclasses.replace(c.trainer, route_replay=False))
            if c.trainer.route_replay else c for c in run.configs]


class ConfigRun:
    """One configuration's steps: its trainer and engine attached to one delta store, then per
    step generate -> old logprobs -> (on-policy reference) -> train -> sync -> record."""

    def __init__(self, actors: LoopActors, run: LoopRun, cfg: LoopConfig, sync_dir: Path):
        self.a, self.run, self.cfg, self.s = actors, run, cfg, run.settings
        self.launch_s = 0.0      # generation time spent in ``launch`` (in process: all of it)
        self.sync_dir = str(sync_dir)

    def steps(self, prog) -> list[dict]:
        a, s = self.a, self.s
        task_id = prog.add_task(f"{self.cfg.name}", total=s.steps)
        self.trn = a.trainer_for(self.cfg, self.sync_dir)
        self.gen = a.generator_for(self.cfg)
        a.meet(self.trn, self.gen)
        # the execution contracts, before the engine takes this configuration's weights
        self.contract = ContractWatch(self.cfg.name, a.ask(self.trn, "contract"), refuse=self.cfg.bitwise)
        try:
            self.check_contract("before the first step")
        except InputError:     # ContractMismatch, or no contract for a bitwise configuration
            a.release(self.trn)
            raise
        sharded = a.ask(self.trn, "sharded_info")   # a multi-rank trainer's store, else None
        a.ask(self.gen, "attach", self.sync_dir, *([sharded] if sharded else []))
        rows: list[dict] = []
        pending = self.launch(0)
        for step in range(s.steps):
            ro_ref = pending
            if s.off_policy and step + 1 < s.steps:
                # queued on the generator before this step's sync: it samples with the current
                # (soon stale) weights while the trainer works
                pending = self.launch(step + 1)
            rows.append(self.one_step(step, ro_ref))
            if not s.off_policy and step + 1 < s.steps:
                pending = self.launch(step + 1)
            r = rows[-1]
            prog.update(task_id, advance=1, description=(
                f"{self.cfg.name}: step {step} reward {r['reward']:.3f} "
                f"|Δ| {r['gap_mean_abs']:.2e} sync {r['sync_payload_bytes'] / 1e3:.0f} kB"))
        a.release(self.trn)
        return rows

    def launch(self, step: int):
        """Queue step ``step``'s rollout (in process: generate it)."""
        t = time.perf_counter()
        s = self.s
        try:
            prompts = make_prompts(s.prompts_per_step, s.prompt_len, 512, s.seed + step)
            if s.turns > 1:
                return self.a.call(self.gen, "generate_multiturn", prompts, self.run.env, max_turns=s.turns,
                                   seed=s.seed + 100_000 * step, **s.sampling())
            return self.a.call(self.gen, "generate", prompts, seed=s.seed + 1000 * step, **s.sampling())
        finally:
            self.launch_s += time.perf_counter() - t

    def one_step(self, step: int, ro_ref) -> dict:
        """Generate -> old logprobs -> (on-policy reference, not timed) -> update -> sync; the
        four times are ``(generate, old logprobs, update, sync)``."""
        rollout, t_gen = self.collect(ro_ref)
        rewards = self.run.task.reward(rollout)
        t_old = time.perf_counter()
        old, recomputed = self.old_logprobs(step, ro_ref, rollout)
        t_old = time.perf_counter() - t_old
        ref_grad = self.reference_gradient(rollout, rewards)   # before the update
        t_train = time.perf_counter()
        metrics = self.a.ask(self.trn, "step", self.wire(ro_ref, rollout), rewards, old)
        t_train = time.perf_counter() - t_train
        trainer_lp = self.trainer_logprobs(step, rollout, recomputed)
        gap = self.gap(trainer_lp, rollout)
        t_sync = time.perf_counter()
        if ref_grad is not None:
            metrics = {**metrics, **compare_gradients(self.a.ask(self.trn, "last_grads"), ref_grad)}
        pub, syn = self.sync()
        t_sync = time.perf_counter() - t_sync
        row = record(self.cfg, step, self.s, rewards, gap, metrics, pub, syn, (t_gen, t_old, t_train, t_sync),
                     trainer_lp, rollout)
        return {**row, "old_logprobs_recomputed": recomputed is not None}

    def check_contract(self, when: str) -> None:
        """Compare the engine's execution contract now with the trainer's (loop_contract.py)."""
        try:
            got = self.a.ask(self.gen, "contract")
        except Exception as e:   # recorded for a configuration that does not refuse
            self.contract.unavailable(f"{type(e).__name__}: {' '.join(str(e).split())[:200]}", when)
            return
        self.contract.compare(got, when)

    def wire(self, ro_ref, rollout):
        """What a trainer call carries: the rollout's object-store reference under Ray."""
        return ro_ref if self.a.use_ray else rollout

    def collect(self, ro_ref) -> tuple[Rollout, float]:
        """The step's rollout and its generation time (what ``launch`` spent included)."""
        t = time.perf_counter()
        rollout = self.a.get(ro_ref)
        t_gen = time.perf_counter() - t + self.launch_s
        self.launch_s = 0.0
        return rollout, t_gen

    def old_logprobs(self, step: int, ro_ref, rollout: Rollout):
        """``(old, recomputed)``: the update's old logprobs, and the trainer's recompute (None
        when skipped). ``bitwise``: the engine's logprobs, the recompute only when due and
        checked bit for bit against them (trainer/old_logprobs.py); otherwise the recompute.
        A lagged rollout (``off_policy``, after step 0: sampled one version behind the trainer's
        weights) is recomputed and not checked, as in every other configuration: the engine's
        logprobs are then not the trainer's (the gap of that step measures the lag)."""
        bitwise = self.cfg.bitwise
        lagged = bool(self.s.off_policy) and step > 0
        if bitwise and not lagged and not recompute_due(step, self.cfg.recompute_old_every):
            return engine_old_logprobs(rollout), None
        recomputed = self.a.ask(self.trn, "logprobs", self.wire(ro_ref, rollout))
        if not bitwise or lagged:
            return recomputed, recomputed
        check_bitwise(recomputed, rollout, step)
        return engine_old_logprobs(rollout), recomputed

    def trainer_logprobs(self, step: int, rollout: Rollout, recomputed):
        """The trainer's logprobs the step's gap is measured with: the recompute, else
        (``bitwise``, recompute skipped) the update's own forward before the optimizer step,
        checked bit for bit against the engine's as well (free: no extra forward)."""
        if recomputed is not None:
            return recomputed
        forward = self.a.ask(self.trn, "last_logprobs")
        check_bitwise(forward, rollout, step, what="update forward's")
        return forward

    @staticmethod
    def gap(trainer_lp, rollout: Rollout):
        """The trainer–engine gap of the step (model tokens)."""
        turn_kw = {"mask": rollout.loss_mask, "turns": rollout.turns} if rollout.is_multi_turn else {}
        return measure(trainer_lp, rollout.rollout_logprobs, cu_seqlens=rollout.response_cu, **turn_kw)

    def reference_gradient(self, rollout: Rollout, rewards):
        """The exact on-policy gradient at the served weights (``measure_grad``), else None."""
        if not self.s.measure_grad:
            return None
        served = self.a.ask(self.trn, "served_state")
        return self.a.reference_for(self.cfg).gradient(served, rollout, rewards, use_support=self.s.truncated)

    def sync(self) -> tuple[dict, dict]:
        """Publish the new weights; the engine applies them in place."""
        pub = self.a.ask(self.trn, "publish")
        # the engine's contract again before it takes the new version (bitwise: refused on a change)
        self.check_contract(f"at sync {pub['version']}")
        syn = self.a.ask(self.gen, "sync", *([pub["sharded"]] if pub.get("sharded") else []))
        return pub, syn


def record(cfg: LoopConfig, step: int, s: LoopSettings, rewards, gap, m: dict, pub: dict, syn: dict,
           times: tuple, trainer_lp, rollout: Rollout) -> dict:
    """One step's row of ``train.json``'s history. ``times``: seconds spent generating, getting
    the old logprobs (the trainer's recompute; ~0 on a bitwise step that skips it), in the update
    (forward + backward + optimizer) and syncing the weights."""
    summ = gap.summary()
    t_gen, t_old, t_train, t_sync = times
    return {"step": step, "reward": float(rewards.mean()),
            "rollout_lag": s.off_policy if step else 0,
            "gap_mean_abs": summ["mean_abs"], "gap_max_abs": summ["max_abs"],
            "gap_frac_bitwise_equal": summ["frac_bitwise_equal"],
            "gap_F2": summ["F_2"],
            "gap_kl_k3": summ["kl_k3"], "loss": m["loss"],
            "clipfrac": m["clipfrac"], "entropy": m["entropy"],
            **{k: v for k, v in m.items() if k.startswith("correction/") or k.startswith("grad_")},
            "sync_version": pub["version"], "sync_payload_bytes": pub["payload_bytes"],
            "sync_raw_bytes": pub["raw_bytes"],
            "engine_update_s": syn["engine_update_s"],
            **({"sync_rank_payload_bytes": pub["rank_payload_bytes"],
                "engine_bytes_read": sum(syn["engine_bytes_read"].values())}
               if "sharded" in pub else {}),
            "time_generate_s": t_gen, "time_old_logprobs_s": t_old, "time_train_s": t_train,
            "time_sync_s": t_sync,
            **({"sync_full_model_bytes": pub["full_model_bytes"]} if "full_model_bytes" in pub else {}),
            **step_metrics(cfg, trainer_lp, rollout, gap)}


def result(run: LoopRun, history: dict, actors: LoopActors) -> LoopResult:
    """The run's ``train.json``: its settings (the schedule, the task, the placement, every
    configuration), the history, the trainer's and engines' hosts."""
    p = run.placement
    task_desc = (asdict(run.task) if isinstance(run.task, TargetSetTask)
                 else {"reward": getattr(run.task, "name", repr(run.task))})
    if run.settings.turns > 1:
        task_desc["env"] = getattr(run.env, "__name__", repr(run.env))
    settings = {**asdict(run.settings), "task": task_desc, "use_ray": p.use_ray, "backend": p.backend,
                "tp": p.tp, "ep": p.ep, "dp": p.dp, "replicas": p.replicas,
                "configs": [config_record(c) for c in run.configs]}
    return LoopResult(settings=settings, history=history,
                      host=host_report(actors.trainer_host, actors.engine_hosts))


# the trainer fields train.json has recorded at the top of each configuration since before the
# TrainerConfig was embedded (readers of older files and their scripts keep working)
RECORD_TRAINER_FIELDS = ("route_replay", "use_support", "correction", "correction_kwargs", "lr",
                         "eps_low", "eps_high")


def config_record(cfg: LoopConfig) -> dict:
    """A configuration as ``train.json`` records it: its fields, the whole ``trainer`` config, the
    trainer fields earlier files carried at the top level, and ``numerics`` as the plan's JSON
    (as the engine and the server receive it); a callable correction by its name."""
    d = asdict(cfg)
    corr = cfg.trainer.correction
    if callable(corr):
        d["trainer"]["correction"] = getattr(corr, "__name__", None) or repr(corr)
    d["numerics"] = cfg.numerics.to_json() if cfg.numerics is not None else None
    return {**{k: d["trainer"][k] for k in RECORD_TRAINER_FIELDS}, **d}
