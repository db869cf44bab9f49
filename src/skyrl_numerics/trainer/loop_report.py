"""What one loop step reports besides the gap, and the loop's PNG.

``step_metrics`` adds to a step's row: ``tis_clip_frac`` (token-TIS clip share, every config with a
correction or a recipe), per-turn gaps and route bytes (multi-turn), per-replica gaps and tokens/s
(``ReplicaRouter`` rollouts). ``write_loop_plot`` draws ``train.png`` from a :class:`LoopResult`.
"""
from __future__ import annotations

import numpy as np

from skyrl_numerics.rollout import Rollout


def step_metrics(cfg, trainer_lp, rollout: Rollout, gap) -> dict:
    """The extra per-step figures of one configuration's rollout (see the module docstring)."""
    return {**_tis_metrics(cfg, trainer_lp, rollout), **_replica_metrics(rollout, trainer_lp),
            **_turn_metrics(rollout, gap)}


def _tis_metrics(cfg, trainer_lp, rollout: Rollout) -> dict:
    """``tis_clip_frac``: the share of (model) tokens whose ratio π_trainer / π_rollout exceeds the
    token-TIS cap (the config's, else 2) — what the correction clips, measured for every config
    (``bitwise``: 0, its ratio is exactly 1)."""
    t = cfg.trainer
    if t.correction != "token_tis" and cfg.recipe is None:
        return {}
    cap = float(t.correction_kwargs.get("cap", 2.0)) if t.correction == "token_tis" else 2.0
    d = np.asarray(trainer_lp, np.float64) - np.asarray(rollout.rollout_logprobs, np.float64)
    if rollout.loss_mask is not None:
        d = d[np.asarray(rollout.loss_mask, bool)]
    return {"tis_clip_frac": float((np.exp(d) > cap).mean()) if d.size else 0.0}


def _turn_metrics(rollout: Rollout, gap) -> dict:
    """Multi-turn: the gap per turn index and the route bytes of the step's trajectories."""
    if not rollout.is_multi_turn:
        return {}
    rb = rollout.meta.get("route_bytes", {})
    return {"gap_per_turn_max_abs": [r["max_abs"] for r in gap.per_turn],
            "gap_per_turn_mean_abs": [r["mean_abs"] for r in gap.per_turn],
            "model_tokens": int(rollout.loss_mask.sum()),
            "observation_tokens": int((~rollout.loss_mask).sum()),
            "route_bytes_delta": rb.get("delta"), "route_bytes_full": rb.get("full_resend")}


def _replica_metrics(rollout: Rollout, trainer_lp) -> dict:
    """Per engine replica (``ReplicaRouter`` rollouts): the gap over its rows and its tokens/s."""
    reps = rollout.meta.get("replica")
    if reps is None:
        return {}
    tok = np.repeat(np.asarray(reps), rollout.response_lens)
    a = np.asarray(trainer_lp, np.float32)
    b = np.asarray(rollout.rollout_logprobs, np.float32)
    out = {"replica_gap_max_abs": [], "replica_gap_frac_bitwise_equal": [],
           "replica_tokens_per_s": []}
    for st in rollout.meta["replicas"]:
        m = tok == st["replica"]
        out["replica_gap_max_abs"].append(float(np.abs(a[m] - b[m]).max()) if m.any() else 0.0)
        out["replica_gap_frac_bitwise_equal"].append(
            float((a[m].view(np.uint32) == b[m].view(np.uint32)).mean()) if m.any() else 1.0)
        out["replica_tokens_per_s"].append(st["tokens_per_s"])
    return out


#: a step's four times (``train.json``) and their labels in the time panel
STEP_TIMES = (("time_generate_s", "generate"), ("time_old_logprobs_s", "old logprobs"),
              ("time_train_s", "train (fwd+bwd+opt)"), ("time_sync_s", "sync"))


def _time_bars(ax, i: int, name: str, rows: list, n_configs: int, col: str) -> None:
    """Configuration ``i``'s step times as stacked bars beside the others' (one shade per part)."""
    w = 0.8 / max(n_configs, 1)
    x = np.asarray([r["step"] for r in rows], float) + (i - (n_configs - 1) / 2) * w
    bottom = np.zeros(len(rows))
    for j, (k, lab) in enumerate(STEP_TIMES):
        v = np.asarray([r.get(k, 0.0) for r in rows])
        ax.bar(x, v, w, bottom=bottom, color=col, alpha=1.0 - 0.22 * j, label=f"{name} {lab}",
               edgecolor="k", linewidth=0.3, hatch=("", "//", "", "..")[j])
        bottom += v


def write_loop_plot(path, result) -> None:
    """Reward and mean |Δ| per step, one line per configuration; with the gradient comparison
    its cosine and relative error; with a recipe (or any TIS figures) also the TIS clip fraction
    and the bytes synced per step (against a full sync); with the step times (every run since
    they exist) the step time split into generate / old logprobs / train / sync."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from skyrl_numerics.atomic import atomic_file

    rows_all = [r for rows in result.history.values() for r in rows]
    has_grad = any("grad_cos_onpolicy" in r for r in rows_all)
    has_recipe = any("tis_clip_frac" in r for r in rows_all)
    has_time = any("time_train_s" in r for r in rows_all)
    panels = ["reward", "gap"] + (["cos", "relerr"] if has_grad else []) \
        + (["tis", "bytes"] if has_recipe else []) + (["time"] if has_time else [])
    ncol = min(len(panels), 4)
    nrow = -(-len(panels) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(5.2 * ncol, 4 * nrow), squeeze=False)
    ax = dict(zip(panels, axes.flat))
    for a in list(axes.flat)[len(panels):]:
        a.set_visible(False)
    floor = 1e-9   # bitwise steps have |Δ| = 0: drawn at the floor of the log axis
    for i, (name, rows) in enumerate(result.history.items()):
        steps = [r["step"] for r in rows]
        col = f"C{i}"
        ax["reward"].plot(steps, [r["reward"] for r in rows], marker="o", label=name, color=col)
        ax["gap"].plot(steps, [max(r["gap_mean_abs"], floor) for r in rows], marker="o", label=name,
                       color=col)
        if has_grad:
            ax["cos"].plot(steps, [r.get("grad_cos_onpolicy", np.nan) for r in rows], marker="o",
                           label=name, color=col)
            ax["relerr"].plot(steps, [max(r.get("grad_relerr_onpolicy", np.nan), floor) for r in rows],
                              marker="o", label=name, color=col)
        if has_recipe:
            ax["tis"].plot(steps, [r.get("tis_clip_frac", np.nan) for r in rows], marker="o",
                           label=name, color=col)
            ax["bytes"].plot(steps, [r["sync_raw_bytes"] for r in rows], marker="o", color=col,
                             label=f"{name} raw")
            ax["bytes"].plot(steps, [r["sync_payload_bytes"] for r in rows], marker="x", ls="--",
                             color=col, label=f"{name} sent (zstd XOR)")
        if has_time:
            _time_bars(ax["time"], i, name, rows, len(result.history), col)
    full = [r["sync_full_model_bytes"] for r in rows_all if "sync_full_model_bytes" in r]
    if has_recipe and full:
        ax["bytes"].axhline(full[0], color="k", ls=":", label="full sync (bf16)")
    titles = {"reward": ("mean reward", "reward", False),
              "gap": ("mean |Δ logprob|", f"trainer–vLLM gap before each update (0 drawn at {floor:g})", True),
              "cos": ("cosine", "gradient vs exact on-policy gradient", False),
              "relerr": ("|g - g*| / |g*|", f"relative gradient error (0 drawn at {floor:g})", True),
              "tis": ("share of tokens", "token-TIS clip fraction (ratio > cap)", False),
              "bytes": ("bytes", "weights synced per step", True),
              "time": ("seconds", "step time: generate / old logprobs / train / sync", False)}
    for k, a in ax.items():
        ylab, title, log = titles[k]
        a.set_xlabel("step"); a.set_ylabel(ylab); a.set_title(title)
        if log:
            a.set_yscale("log")
        a.legend(fontsize=7)
    fig.tight_layout()
    with atomic_file(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
