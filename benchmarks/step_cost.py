"""What exactness costs per RL step: ``plain``, ``aligned`` and ``bitwise`` from the same weights in
one run of this script (``trainer/loop.py``'s ``run_loop`` per configuration, each from the
checkpoint, the engines reset to it), each step split into its four times — generate, old
logprobs (the trainer's recompute), train (forward + backward + optimizer), sync (publish + the
engine's in-place update).

``bitwise`` takes the engine's logprobs as the old logprobs (recompute every 10 steps, checked
bit for bit). A fourth configuration, ``bitwise_recompute`` (``recompute_old_every=1``: the
recompute every step, as before), measures what the skip saves. Reported per configuration: the
mean of each time over the measured steps (step 0 left out: first-call warm-up, and the step
every bitwise run recomputes), the step total, its ratio to ``plain``, and the saving.

    .venv/bin/python benchmarks/step_cost.py                     # the tiny Qwen3-MoE
    .venv/bin/python benchmarks/step_cost.py --family qwen3 --config '{"hidden_size": 4096, ...}'
        # a dense model's layer (the tiny qwen3 with these overrides)
    .venv/bin/python benchmarks/step_cost.py --real-dims --layers 1 --vocab 8192 --experts 16 --steps 3
        # Qwen3-MoE-30B-A3B's layer (benchmarks/real_dims.py: hidden 2048, 32 q / 4 kv heads of
        # 128, experts top-8 of width 768: each token's work as in the real layer) with one layer,
        # a smaller vocabulary and 16 of its 64 experts, so that the fp32 trainers (master weights
        # + AdamW + gradients: ~16-24 B per parameter) fit what a shared 24 GB host has free

``--json PATH`` also writes every row and the summary. Ratios are within this run (same weights,
same prompts and seeds per step, the configurations one after the other on one host).

On a shared host wall time includes waiting for a core. The trainer runs in this process, so the
script also takes this process's CPU time (``time.process_time``: every thread, no waiting)
around the trainer's ``logprobs`` and ``step`` calls — ``cpu_old_logprobs_s`` and
``cpu_train_s``, the work itself, which moves far less with the load (the engine's generation
runs in vLLM's engine-core process and has only its wall time).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from pathlib import Path

TIMES = ("time_generate_s", "time_old_logprobs_s", "time_train_s", "time_sync_s")
CPU_TIMES = ("cpu_old_logprobs_s", "cpu_train_s")
#: config name -> per step {"cpu_old_logprobs_s", "cpu_train_s"} (TimedTrainer)
CPU: dict[str, list[dict]] = {}


def timed_trainer():
    """The loop's trainer worker with this process's CPU time taken around ``logprobs`` and
    ``step`` (instrumentation only: the same class, the same calls)."""
    from skyrl_numerics.trainer.workers import TrainerWorker

    class TimedTrainer(TrainerWorker):
        def __init__(self, model_dir, config, *args, **kw):
            super().__init__(model_dir, config, *args, **kw)
            self.rows = CPU.setdefault(config.name, [])
            self.rows.append({"cpu_old_logprobs_s": 0.0})

        def logprobs(self, rollout):
            t = time.process_time()
            try:
                return super().logprobs(rollout)
            finally:
                self.rows[-1]["cpu_old_logprobs_s"] = time.process_time() - t

        def step(self, rollout, rewards, old_logprobs):
            t = time.process_time()
            try:
                return super().step(rollout, rewards, old_logprobs)
            finally:
                self.rows[-1]["cpu_train_s"] = time.process_time() - t
                self.rows.append({"cpu_old_logprobs_s": 0.0})
    return TimedTrainer


def checkpoint(a) -> Path:
    from skyrl_numerics.models import build_tiny_model

    if not a.real_dims:
        return build_tiny_model(a.family, **json.loads(a.config))
    from real_dims import CONFIGS     # (benchmarks/real_dims.py, beside this script)

    return build_tiny_model("qwen3_moe", **{**CONFIGS["qwen3_moe"], "num_hidden_layers": a.layers,
                                           "vocab_size": a.vocab, "num_experts": a.experts})


def configs(every: int, stock_backward: bool = False) -> list:
    """plain, aligned, bitwise, bitwise_recompute; with ``stock_backward`` also
    ``bitwise_stock_bwd``: bitwise with ``invariant_backward="stock"`` (the matmuls' gradient
    GEMMs on torch's fp32 GEMM; the forward, and Δ = 0, unchanged)."""
    from skyrl_numerics.trainer.loop import CONFIGS

    bw = dataclasses.replace(CONFIGS["bitwise"], recompute_old_every=every)
    out = [CONFIGS["plain"], CONFIGS["aligned"], bw,
           dataclasses.replace(bw, name="bitwise_recompute", recompute_old_every=1)]
    if stock_backward:
        out.append(dataclasses.replace(bw, name="bitwise_stock_bwd", trainer=dataclasses.replace(
            bw.trainer, invariant_backward="stock")))
    return out


def close_stock_engine(model) -> None:
    """Shut the process-wide stock engine the plain / aligned runs used (the loop leaves cached
    engines running): a 24 GB host does not hold it beside the invariant engine and trainer at
    real dims."""
    from skyrl_numerics.engine.generator import get_generator
    from skyrl_numerics.trainer.workers import has_routers

    get_generator(str(model), capture_routes=has_routers(model)).close()


def summarize(history: dict, skip: int) -> dict:
    """Per configuration: the mean of each time over steps >= ``skip`` and the step total."""
    out = {}
    for name, rows in history.items():
        rows = [{**r, **CPU.get(name, [{}] * len(rows))[r["step"]]} for r in rows]
        rows = [r for r in rows if r["step"] >= skip] or rows
        mean = {k: sum(r[k] for r in rows) / len(rows) for k in TIMES + CPU_TIMES if k in rows[0]}
        out[name] = {**mean, "step_s": sum(mean[k] for k in TIMES), "steps_averaged": len(rows),
                     "recomputed_steps": sum(bool(r.get("old_logprobs_recomputed")) for r in rows),
                     "gap_max_abs": max(r["gap_max_abs"] for r in rows)}
    return out


def table(summ: dict) -> str:
    base = summ["plain"]["step_s"]
    lines = ["| config | generate s | old logprobs s | train s | sync s | step s | × plain | "
             "CPU s: old logprobs / train | max \\|Δ\\| |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, s in summ.items():
        lines.append(f"| {name} | {s['time_generate_s']:.2f} | {s['time_old_logprobs_s']:.2f} | "
                     f"{s['time_train_s']:.2f} | {s['time_sync_s']:.2f} | {s['step_s']:.2f} | "
                     f"{s['step_s'] / base:.2f}× | {s.get('cpu_old_logprobs_s', 0):.2f} / "
                     f"{s.get('cpu_train_s', 0):.2f} | {s['gap_max_abs']:.2g} |")
    return "\n".join(lines)


def saving(summ: dict, every: int) -> dict:
    """What the skipped recompute saves per step (bitwise_recompute - bitwise), and bitwise's
    step with the recompute amortized at its period."""
    bw, rc = summ["bitwise"], summ["bitwise_recompute"]
    old_saved = rc["time_old_logprobs_s"] - bw["time_old_logprobs_s"]
    amortized = bw["step_s"] + rc["time_old_logprobs_s"] / every
    cpu = {n: summ[n].get("cpu_old_logprobs_s", 0.0) + summ[n].get("cpu_train_s", 0.0) for n in summ}
    return {"old_logprobs_saved_s": old_saved, "step_saved_frac": 1 - bw["step_s"] / rc["step_s"],
            "cpu_old_logprobs_saved_s": rc.get("cpu_old_logprobs_s", 0.0) - bw.get("cpu_old_logprobs_s", 0.0),
            "cpu_trainer_over_plain": {n: c / cpu["plain"] if cpu["plain"] else None for n, c in cpu.items()},
            "bitwise_amortized_step_s": amortized,
            "bitwise_amortized_over_plain": amortized / summ["plain"]["step_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--real-dims", action="store_true", help="Qwen3-MoE-30B-A3B layer dims (real_dims.py)")
    ap.add_argument("--layers", type=int, default=1, help="--real-dims: decoder layers")
    ap.add_argument("--vocab", type=int, default=8192, help="--real-dims: vocabulary (the real one: 151936)")
    ap.add_argument("--experts", type=int, default=64,
                    help="--real-dims: routed experts (the real 64; fewer keep each token's work — "
                         "top-8 of width 768 — and shrink what the optimizer and the sync carry)")
    ap.add_argument("--family", default="qwen3_moe",
                    help="the tiny model's family (without --real-dims), e.g. qwen3 for a dense one")
    ap.add_argument("--config", default="{}",
                    help="JSON object of overrides of that tiny config (without --real-dims), e.g. a "
                         "dense Qwen3-8B layer: hidden_size 4096, intermediate_size 12288, ...")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--every", type=int, default=10, help="bitwise: recompute_old_every")
    ap.add_argument("--json", default=None)
    ap.add_argument("--stock-backward", action="store_true",
                    help="also bitwise with invariant_backward='stock' (bitwise_stock_bwd)")
    a = ap.parse_args()

    from skyrl_numerics.host import host_info
    from skyrl_numerics.trainer import loop_actors
    from skyrl_numerics.trainer.loop import LoopRun, LoopSettings, run_loop

    loop_actors.TrainerWorker = timed_trainer()

    model = checkpoint(a)
    settings = LoopSettings(steps=a.steps, prompts_per_step=a.prompts, samples_per_prompt=a.samples,
                            max_tokens=a.max_tokens, measure_grad=False)
    t0 = time.perf_counter()
    history: dict = {}
    stock_open = True
    for cfg in configs(a.every, a.stock_backward):     # one loop run per configuration: each one's rows kept at once
        if cfg.bitwise and stock_open:
            close_stock_engine(model)     # its memory, before the invariant engine and trainer
            stock_open = False
        history.update(run_loop(LoopRun(str(model), [cfg], settings, progress=False)).history)
        if a.json:
            Path(a.json).write_text(json.dumps({"args": vars(a), "partial": True, "history": history,
                                                "cpu": CPU}, indent=1, default=str))
    wall = time.perf_counter() - t0
    summ = summarize(history, skip=1)
    sav = saving(summ, a.every)
    h = host_info()
    flags = " ".join(f for f, on in h["isa_flags"].items() if on)
    print(f"host: {h['cpu_model']} ({h['cpu_count']} CPUs), ISA {h['isa']} [{flags}], "
          f"{platform.python_version()}; model {model.name}; {a.steps} steps × {a.prompts} prompts × "
          f"{a.samples} samples × {a.max_tokens} tokens; mean over steps 1..{a.steps - 1}; run {wall:.0f} s")
    print(table(summ))
    print(f"bitwise/plain {summ['bitwise']['step_s'] / summ['plain']['step_s']:.2f}×, "
          f"aligned/plain {summ['aligned']['step_s'] / summ['plain']['step_s']:.2f}×; "
          f"skipped recompute saves {sav['old_logprobs_saved_s']:.2f} s/step "
          f"(measured step walls {sav['step_saved_frac']:.0%} apart, the other parts' noise included); "
          f"with the recompute every "
          f"{a.every} steps bitwise costs {sav['bitwise_amortized_step_s']:.2f} s/step = "
          f"{sav['bitwise_amortized_over_plain']:.2f}× plain")
    print("trainer CPU (old logprobs + train) over plain's: " + ", ".join(
        f"{n} {r:.2f}×" for n, r in sav["cpu_trainer_over_plain"].items() if r is not None)
        + f"; the skip saves {sav['cpu_old_logprobs_saved_s']:.2f} CPU s/step")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "host": h, "model": str(model), "wall_s": wall,
                                            "summary": summ, "saving": sav, "history": history, "cpu": CPU},
                                           indent=1, default=str))


if __name__ == "__main__":
    main()
