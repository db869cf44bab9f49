"""The seed's collapse experiment at our scale: GRPO on the trained tiny MoE with the causes the seed
names — MoE routing, top-p 0.8 truncation, quantized (FP8) serving — per configuration and seed.

The model is the trained tiny ``--family`` checkpoint (``skyrl_numerics.trained_models``: pre-trained
on the copy task, peaked distributions); the reward is that task's verifier
(``skyrl_numerics.copy_task:reward``). Every configuration's engine is the invariant vLLM engine
serving W8A8 FP8 (``fp8_tensor_weight/fp8_token``) on the attention and expert linears — vLLM CPU
has no FP8 kernels, so the invariant engine's FP8 numerics stand in for them (as in the seed
recipes, ``trainer/seed_recipes.py``). The non-bitwise trainers are the HF model in float32 that
fake-quantizes the same linears (the seeds' published setup, ``trainer/published.py``); their gap to
the engine is kernels, fake-quant placement and routing flips. Configurations:

==========  =================================================================================
plain       no alignment piece
r3          routing replay only (the trainer uses the engine's experts)
support     top-p/top-k support replay only (the trainer renormalizes over the engine's support)
tis         token TIS only (cap 2)
aligned     R3 + support replay + token TIS (the loop's ``aligned``)
bitwise     invariant engine and invariant trainer with the same FP8 numerics: Δ = 0 (on-policy)
==========  =================================================================================

Per step (``trainer/loop.py``'s rows): reward, mean / max |Δ| (trainer vs engine logprob of the
sampled token), the policy entropy (the update's), ``tis_clip_frac`` (share of tokens whose ratio
π_trainer/π_engine exceeds 2: outside the TIS bound; recorded for every configuration), and
``grad_cos_onpolicy`` (cosine of the configuration's gradient before clipping to the exact
on-policy gradient of the same batch at the served weights: the loop's ``measure_grad``, an
invariant model with the engine's numbers).

    .venv/bin/python benchmarks/collapse.py --steps 200 --seeds 0,1,2 \\
        --configs plain,r3,support,tis,aligned,bitwise --out artifacts/collapse

writes ``OUT/collapse.json`` (settings, the trained model's scores, every row per configuration and
seed; rewritten after each seed, so a cut run keeps what finished) and ``OUT/collapse.png``.
``--plot-only`` redraws the PNG from the JSON. One engine serves every configuration and seed (the
process-wide cached engine; each configuration starts from the checkpoint).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from pathlib import Path

METRICS = ("reward", "gap_mean_abs", "gap_max_abs", "entropy", "tis_clip_frac", "grad_cos_onpolicy")
KEEP = METRICS + ("step", "clipfrac", "grad_relerr_onpolicy", "gap_frac_bitwise_equal", "time_generate_s",
                  "time_old_logprobs_s", "time_train_s", "time_sync_s")
TITLES = {"entropy": "entropy of what the trainer trains\n(full vocabulary; the sampler's support where replayed)",
          "tis_clip_frac": "share of tokens with π_trainer/π_engine > 2"}
ALL_CONFIGS = ("plain", "r3", "support", "tis", "aligned", "bitwise")


def fp8_plan():
    """W8A8 FP8 (per-channel weights, dynamic per-token activations) on attention and experts."""
    from skyrl_numerics.invariant.numerics import LinearFormat, NumericsPlan

    f = LinearFormat(weight="fp8_tensor_weight", act="fp8_token")
    return NumericsPlan(formats={"attention": f, "experts": f})


def loop_config(name: str, plan, serving: str, lr: float):
    """The named configuration, its engine serving ``plan`` (None: bf16)."""
    from skyrl_numerics.trainer.config import TrainerConfig
    from skyrl_numerics.trainer.loop import LoopConfig

    tis = dict(correction="token_tis", correction_kwargs={"cap": 2.0})
    trainers = {"plain": TrainerConfig(), "r3": TrainerConfig(route_replay=True),
                "support": TrainerConfig(use_support=True), "tis": TrainerConfig(**tis),
                "aligned": TrainerConfig(route_replay=True, use_support=True, **tis),
                "bitwise": TrainerConfig(use_support=True)}
    if name not in trainers:
        raise SystemExit(f"unknown configuration {name!r}; expected some of {ALL_CONFIGS}")
    # recipe: a name for the serving setup (train.json records it; the loop then records
    # tis_clip_frac for every configuration)
    trainer = dataclasses.replace(trainers[name], lr=lr)
    return LoopConfig(name, trainer, bitwise=name == "bitwise", numerics=plan,
                      recipe=f"collapse-{serving}" if plan is not None else None)


def run(args) -> dict:
    from skyrl_numerics import copy_task
    from skyrl_numerics.trained_models import build_trained_model
    from skyrl_numerics.trainer.loop import LoopRun, LoopSettings, run_loop
    from skyrl_numerics.trainer.reward import RewardTask

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = build_trained_model(args.family)
    plan = fp8_plan() if args.serving == "fp8" else None
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    configs = [loop_config(n, plan, args.serving, args.lr) for n in names]
    seeds = [int(s) for s in args.seeds.split(",")]
    doc = {"command": args.command, "host": {"machine": platform.machine(), "cpus": os.cpu_count()},
           "model": json.loads((model_dir / "skyrl_numerics.json").read_text()),
           "settings": {k: v for k, v in vars(args).items() if k != "command"},
           "runs": {n: {} for n in names}, "seconds": {}}
    for seed in seeds:
        t = time.time()
        settings = LoopSettings(steps=args.steps, prompts_per_step=args.prompts,
                                samples_per_prompt=args.samples, max_tokens=args.max_tokens,
                                top_p=args.top_p, top_k=args.top_k, seed=seed, measure_grad=True,
                                snapshot_every=args.steps + 1)
        res = run_loop(LoopRun(str(model_dir), configs, settings,
                               task=RewardTask(copy_task.reward, name="copy_task"),
                               work_dir=out / f"sync-{seed}", progress=args.progress))
        for n, rows in res.history.items():
            doc["runs"][n][str(seed)] = [{k: r[k] for k in KEEP if k in r} for r in rows]
        doc["seconds"][str(seed)] = time.time() - t
        doc["host"].update({k: v for k, v in res.to_dict().items() if k in ("host", "engine_host")})
        (out / "collapse.json").write_text(json.dumps(doc, indent=1))
        print(f"seed {seed}: {time.time() - t:.0f} s", flush=True)
    return doc


SAME = ("family", "steps", "prompts", "samples", "max_tokens", "top_p", "top_k", "serving", "lr")


def merge(dirs: list[str]) -> dict:
    """One document from several runs' ``collapse.json`` (each a part of the configurations and
    seeds, the same settings ``SAME``); a (configuration, seed) in two of them is refused."""
    docs = [(d, json.loads((Path(d) / "collapse.json").read_text())) for d in dirs]
    first, doc = docs[0][1], json.loads(json.dumps(docs[0][1]))
    doc.pop("commands", None)
    doc["command"] = [c for _, d in docs for c in ([d["command"]] if "command" in d else d["commands"])]
    doc["seconds"] = {d: x["seconds"] for d, x in docs}
    for path, other in docs[1:]:
        diff = [k for k in SAME if other["settings"][k] != first["settings"][k]]
        if diff:
            raise SystemExit(f"{path}/collapse.json: settings {diff} differ from {docs[0][0]}'s")
        for name, by_seed in other["runs"].items():
            mine = doc["runs"].setdefault(name, {})
            both = sorted(set(mine) & set(by_seed))
            if both:
                raise SystemExit(f"{path}/collapse.json: {name} seeds {both} are in two runs")
            mine.update(by_seed)
    doc["settings"]["configs"] = ",".join(doc["runs"])
    doc["settings"]["seeds"] = {n: sorted(s, key=int) for n, s in doc["runs"].items()}
    return doc


def summary(doc: dict) -> dict:
    """Per configuration: each metric's mean over the seeds, first and last quarter of the steps."""
    import numpy as np

    out = {}
    for name, by_seed in doc["runs"].items():
        if not by_seed:
            continue
        out[name] = {}
        for m in METRICS:
            arr = np.array([[r.get(m, np.nan) for r in rows] for rows in by_seed.values()], float)
            q = max(arr.shape[1] // 4, 1)
            out[name][m] = {"first": float(np.nanmean(arr[:, :q])), "last": float(np.nanmean(arr[:, -q:])),
                            "last_seed_spread": float(np.nanstd(np.nanmean(arr[:, -q:], axis=1)))}
    return out


def plot(doc: dict, path: Path) -> None:
    """One panel per metric: the mean over seeds per configuration, the seeds' min-max shaded."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, m in zip(axes.flat, METRICS):
        for name, by_seed in doc["runs"].items():
            if not by_seed:
                continue
            n = min(len(rows) for rows in by_seed.values())
            arr = np.array([[r.get(m, np.nan) for r in rows[:n]] for rows in by_seed.values()], float)
            if np.isnan(arr).all():
                continue
            w = max(1, n // 40)           # a rolling mean over w steps (1 for short runs)
            x = np.arange(n - w + 1) + (w - 1) / 2

            def smooth(y):               # NaN-aware: a step without the metric does not blank its window
                win = np.lib.stride_tricks.sliding_window_view(y, w)
                ok = ~np.isnan(win)
                return np.where(ok.any(1), np.where(ok, win, 0).sum(1) / np.maximum(ok.sum(1), 1), np.nan)
            line, = ax.plot(x, smooth(np.nanmean(arr, 0)), label=f"{name} ({len(by_seed)} seeds)", lw=1.2)
            ax.fill_between(x, smooth(np.nanmin(arr, 0)), smooth(np.nanmax(arr, 0)), color=line.get_color(),
                            alpha=0.15)
        ax.set_title(TITLES.get(m, m), fontsize=10)
        ax.set_xlabel("step" + (f" (rolling mean over {max(1, n // 40)})" if n >= 80 else ""))
        if m.startswith("gap"):
            ax.set_yscale("symlog", linthresh=1e-4)
    axes.flat[0].legend(fontsize=8)
    s = doc["settings"]
    fig.suptitle(f"GRPO on the trained tiny {s['family']}, {s['serving']} serving, top-p {s['top_p']}: "
                 f"{s['prompts']}x{s['samples']} samples x {s['max_tokens']} tokens per step")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="qwen3_moe", choices=["qwen3_moe", "deepseek_v3"])
    p.add_argument("--configs", default=",".join(ALL_CONFIGS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--top-p", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=16, help="the support replay needs top-k > 1")
    p.add_argument("--serving", default="fp8", choices=["fp8", "bf16"])
    p.add_argument("--lr", type=float, default=1e-3,
                   help="Adam lr of every configuration (the loop's default 1e-2 is for the random "
                        "tiny models: on the trained one it collapses every configuration, bitwise "
                        "included, within 4 steps)")
    p.add_argument("--out", default="artifacts/collapse")
    p.add_argument("--progress", action="store_true")
    p.add_argument("--plot-only", action="store_true", help="redraw OUT/collapse.png from OUT/collapse.json")
    p.add_argument("--merge", metavar="DIR[,DIR...]",
                   help="write OUT/collapse.{json,png} from these runs' collapse.json (the same settings, "
                        "each a part of the configurations and seeds) instead of running")
    p.add_argument("--threads", type=int,
                   help="intra-op threads of the trainer and the engine (OMP_NUM_THREADS; the engine's "
                        "threads unbound): on a shared 2-core host 1 made a step ~7x faster (below)")
    args = p.parse_args()
    args.command = "benchmarks/collapse.py " + " ".join(os.sys.argv[1:])
    if args.threads:
        os.environ.update(OMP_NUM_THREADS=str(args.threads), VLLM_CPU_OMP_THREADS_BIND="nobind")
    out = Path(args.out)
    if args.merge:
        out.mkdir(parents=True, exist_ok=True)
        doc = merge(args.merge.split(","))
    else:
        doc = json.loads((out / "collapse.json").read_text()) if args.plot_only else run(args)
    doc["summary"] = summary(doc)
    (out / "collapse.json").write_text(json.dumps(doc, indent=1))
    plot(doc, out / "collapse.png")
    print(json.dumps(doc["summary"], indent=1))


if __name__ == "__main__":
    main()
