"""The thin RL loop: vLLM generates, the trainer scores and updates, deltas flow back into vLLM.

One step of one configuration::

    rollout  = generator.generate(prompts, n=G)            # real vLLM; routes + support captured
    rewards  = task.reward(rollout)                        # verifiable: no model involved
    old_lp   = trainer.logprobs(rollout)                   # with this config's alignment pieces
    gap      = measure(old_lp, rollout.rollout_logprobs)   # mean |Δ|, F(2), KL k3 per step
    metrics  = trainer.step(rollout, rewards, old_logprobs=old_lp)   # GRPO, PPO-clip, correction
    manifest = publisher.publish(bf16 weights)             # XOR delta vs the last version, zstd
    receiver.sync(); update_vllm_weights(engine, ...)      # in place, no restart

Generator and trainer are :class:`GeneratorWorker` / :class:`TrainerWorker`; with ``use_ray`` they
run as Ray actors on a local cluster and rollouts travel through the object store (numpy arrays
and packed routes come back as views of the shared buffer, not copies).

Configurations (``plain``, ``aligned``, …) run one after the other from the same initial weights
(the engine is reset by a full-snapshot sync), so their reward and gap curves compare directly.
"""
from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from skyrl_numerics.rollout import Rollout


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


# ---- configurations ------------------------------------------------------------------------
@dataclass
class LoopConfig:
    name: str = "plain"
    route_replay: bool = False
    use_support: bool = False
    correction: str | None = None          # a skyrl_numerics.correction function name
    correction_kwargs: dict = field(default_factory=dict)
    lr: float = 1e-2


CONFIGS = {
    "plain": LoopConfig("plain"),
    "aligned": LoopConfig("aligned", route_replay=True, use_support=True,
                          correction="token_tis", correction_kwargs={"cap": 2.0}),
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


# ---- workers (plain classes; Ray actors when use_ray) ----------------------------------------
class GeneratorWorker:
    """Owns the vLLM engine and a delta receiver; applies new versions to the engine in place."""

    def __init__(self, model_dir: str):
        from skyrl_numerics.trainer.engine.generator import get_generator

        self.model_dir = model_dir
        self.gen = get_generator(model_dir, capture_routes=True)
        self.receiver = None

    def restore(self) -> None:
        """Put the checkpoint's own weights back into the (possibly shared, cached) engine."""
        from safetensors.torch import load_file

        from skyrl_numerics.trainer.sync.vllm import update_vllm_weights

        update_vllm_weights(self.gen, load_file(str(Path(self.model_dir) / "model.safetensors")))

    def close(self) -> None:
        """Shut the engine down (its worker processes would outlive a killed Ray actor)."""
        self.gen.close()

    def attach(self, sync_dir: str) -> dict:
        """Follow a new publisher (a new configuration): load its full snapshot into the engine."""
        from skyrl_numerics.trainer.sync.weight_sync import DeltaReceiver
        from skyrl_numerics.trainer.sync.vllm import update_vllm_weights

        self.receiver = DeltaReceiver(sync_dir)
        applied = self.receiver.sync()
        up = update_vllm_weights(self.gen, self.receiver.state)
        return {"version": self.receiver.version, "versions": len(applied),
                "engine_update_s": up.total_s}

    def sync(self) -> dict:
        from skyrl_numerics.trainer.sync.vllm import update_vllm_weights

        applied = self.receiver.sync()
        changed = sorted({n for m in applied for n in m.changed})
        up = update_vllm_weights(self.gen, self.receiver.state, changed=changed)
        return {"version": self.receiver.version, "engine_update_s": up.total_s,
                "engine_update_tensors": up.tensors,
                "payload_bytes": sum(m.payload_nbytes for m in applied),
                "raw_bytes": sum(m.raw_nbytes for m in applied)}

    def generate(self, prompts, **sampling) -> Rollout:
        return self.gen.generate(prompts, **sampling)


class TrainerWorker:
    """Owns the policy (fp32 master weights), the optimizer and the delta publisher."""

    def __init__(self, model_dir: str, config: LoopConfig, sync_dir: str, snapshot_every: int):
        import functools

        from skyrl_numerics import correction as corr
        from skyrl_numerics.models import load_hf_model
        from skyrl_numerics.trainer.fsdp.trainer import FSDPTrainer, TrainerConfig
        from skyrl_numerics.trainer.sync.weight_sync import DeltaPublisher

        fn = None
        if config.correction:
            fn = functools.partial(getattr(corr, config.correction), **config.correction_kwargs)
        self.trainer = FSDPTrainer(load_hf_model(model_dir, dtype="float32"), TrainerConfig(
            lr=config.lr, route_replay=config.route_replay, use_support=config.use_support,
            correction=fn, micro_batch_size=16, weight_decay=0.0))
        self.publisher = DeltaPublisher(sync_dir, snapshot_every=snapshot_every)
        self.publish(full=True)

    def _served_state(self) -> dict:
        """The weights as the engine serves them: checkpoint names, bf16."""
        import torch

        from skyrl_numerics.trainer.sync.vllm import checkpoint_state_dict

        sd = checkpoint_state_dict(self.trainer.model)
        return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in sd.items()}

    def publish(self, full: bool = False) -> dict:
        m = self.publisher.publish(self._served_state(), full=full)
        return {"version": m.version, "full": m.is_full, "changed": len(m.changed),
                "payload_bytes": m.payload_nbytes, "raw_bytes": m.raw_nbytes}

    def logprobs(self, rollout: Rollout) -> np.ndarray:
        return self.trainer.logprobs(rollout)

    def step(self, rollout: Rollout, rewards, old_logprobs) -> dict:
        return self.trainer.step(rollout, rewards, old_logprobs=old_logprobs)


# ---- the loop --------------------------------------------------------------------------------
@dataclass
class LoopResult:
    settings: dict
    history: dict[str, list[dict]]     # config name -> per-step metrics

    def to_dict(self) -> dict:
        return {"settings": self.settings, "history": self.history}


def _remote(cls, use_ray: bool):
    if not use_ray:
        return cls, (lambda ref: ref)
    import ray

    return ray.remote(num_cpus=0)(cls), ray.get


def run_loop(model_dir: str, configs: list[LoopConfig], settings: LoopSettings | None = None, *,
             task: TargetSetTask | None = None, use_ray: bool = False, work_dir=None,
             progress: bool = True) -> LoopResult:
    """Run ``settings.steps`` GRPO steps for each configuration; return per-step metrics.
    The engine gets the checkpoint's weights back at the end (it may be a shared, cached one).
    ``settings.off_policy = 1`` overlaps generation of step s+1 with the update of step s."""
    from rich.progress import Progress

    from skyrl_numerics.doctor import make_prompts
    from skyrl_numerics.gap import measure

    s = settings or LoopSettings()
    task = task or TargetSetTask()
    # absolute: Ray actors do not share the driver's working directory
    work = Path(work_dir or tempfile.mkdtemp(prefix="skyrl_loop_")).resolve()
    started_ray = False
    if use_ray:
        import ray

        if not ray.is_initialized():
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            started_ray = True
    Gen, get = _remote(GeneratorWorker, use_ray)
    Trn, _ = _remote(TrainerWorker, use_ray)
    call = (lambda obj, name, *a, **k: getattr(obj, name).remote(*a, **k)) if use_ray else \
        (lambda obj, name, *a, **k: getattr(obj, name)(*a, **k))
    gen = Gen.remote(str(model_dir)) if use_ray else Gen(str(model_dir))
    history: dict[str, list[dict]] = {}
    sampling = dict(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                    max_tokens=s.max_tokens, n=s.samples_per_prompt,
                    capture_support=s.top_k > 1)
    try:
        with Progress(disable=not progress) as prog:
            for cfg in configs:
                task_id = prog.add_task(f"{cfg.name}", total=s.steps)
                sync_dir = str(work / f"sync-{cfg.name}")
                args = (str(model_dir), cfg, sync_dir, s.snapshot_every)
                trn = Trn.remote(*args) if use_ray else Trn(*args)
                get(call(gen, "attach", sync_dir))
                rows = history[cfg.name] = []

                def launch(step):
                    prompts = make_prompts(s.prompts_per_step, s.prompt_len, 512, s.seed + step)
                    return call(gen, "generate", prompts, seed=s.seed + 1000 * step, **sampling)

                pending = launch(0)
                for step in range(s.steps):
                    ro_ref = pending
                    if s.off_policy and step + 1 < s.steps:
                        # queued on the generator before this step's sync: it samples with the
                        # current (soon stale) weights while the trainer works
                        pending = launch(step + 1)
                    rollout = get(ro_ref)
                    rewards = task.reward(rollout)
                    old = get(call(trn, "logprobs", ro_ref if use_ray else rollout))
                    g = measure(old, rollout.rollout_logprobs, cu_seqlens=rollout.response_cu)
                    m = get(call(trn, "step", ro_ref if use_ray else rollout, rewards, old))
                    pub = get(call(trn, "publish"))
                    syn = get(call(gen, "sync"))
                    if not s.off_policy and step + 1 < s.steps:
                        pending = launch(step + 1)
                    summ = g.summary()
                    rows.append({"step": step, "reward": float(rewards.mean()),
                                 "rollout_lag": s.off_policy if step else 0,
                                 "gap_mean_abs": summ["mean_abs"], "gap_F2": summ["F_2"],
                                 "gap_kl_k3": summ["kl_k3"], "loss": m["loss"],
                                 "clipfrac": m["clipfrac"], "entropy": m["entropy"],
                                 **{k: v for k, v in m.items() if k.startswith("correction/")},
                                 "sync_version": pub["version"], "sync_payload_bytes": pub["payload_bytes"],
                                 "sync_raw_bytes": pub["raw_bytes"],
                                 "engine_update_s": syn["engine_update_s"]})
                    prog.update(task_id, advance=1, description=(
                        f"{cfg.name}: step {step} reward {rows[-1]['reward']:.3f} "
                        f"|Δ| {summ['mean_abs']:.2e} sync {pub['payload_bytes'] / 1e3:.0f} kB"))
                if use_ray:
                    import ray

                    ray.kill(trn)
    finally:
        get(call(gen, "restore"))
        if use_ray:
            import ray

            get(call(gen, "close"))
            ray.kill(gen)
            if started_ray:  # leave the process as we found it
                ray.shutdown()
    return LoopResult(settings={**asdict(s), "task": asdict(task), "use_ray": use_ray,
                                "configs": [asdict(c) for c in configs]}, history=history)


def write_loop_plot(path, result: LoopResult) -> None:
    """Reward and mean |Δ| per step, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from skyrl_numerics.atomic import atomic_file

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in result.history.items():
        steps = [r["step"] for r in rows]
        a1.plot(steps, [r["reward"] for r in rows], marker="o", label=name)
        a2.plot(steps, [r["gap_mean_abs"] for r in rows], marker="o", label=name)
    a1.set_xlabel("step"); a1.set_ylabel("mean reward"); a1.set_title("reward")
    a2.set_xlabel("step"); a2.set_ylabel("mean |Δ logprob|"); a2.set_yscale("log")
    a2.set_title("trainer–vLLM gap (before each update)")
    for a in (a1, a2):
        a.legend()
    fig.tight_layout()
    with atomic_file(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
