"""Multi-turn trajectories: route bytes and time in the real engine, per-turn gap cost.

Every number is a ratio against a baseline measured in the same process:

1. **R3 across turns in the real vLLM CPU engine** (tiny Qwen3-MoE, ``generate_multiturn`` with the
   toy key-value tool, ``T`` turns): the routes shipped per trajectory with turn deltas (each
   position once, ``RouteTrace``) against a full-prefix resend every turn, and the wall time of
   the whole multi-turn generation (capture + fetch + assembly included) with deltas against the
   resend. The two assemble the same routes (checked here; tested in tests/e2e/test_multiturn.py).
   The invariant engine is used so that both runs sample the same tokens.
2. **Per-turn gap cost**: ``gap.measure(..., turns=)`` (the whole report plus one row per turn)
   against ``gap.measure`` of the same masked tokens without turns, on ``N`` synthetic tokens of
   ``T``-turn trajectories.

Script: ``python benchmarks/bench_multiturn.py [--turns 10] [--out DIR]`` (markdown table, JSON,
PNG of route bytes per turn); pytest-benchmark: ``pytest benchmarks/bench_multiturn.py
--benchmark-only``.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from _timing import best


def engine_routes(turns: int = 10, trajectories: int = 4, max_tokens: int = 8, prompt_len: int = 136):
    from skyrl_numerics.rollout.prompts import make_prompts
    from skyrl_numerics.models import build_tiny_model
    from skyrl_numerics.trainer import get_generator
    from skyrl_numerics.engine.multiturn import KeyValueEnv

    gen = get_generator(build_tiny_model("qwen3_moe"), batch_invariant=True, capture_routes=True)
    prompts = make_prompts(trajectories, prompt_len, gen.vocab_size, seed=7)
    kw = dict(max_turns=turns, max_tokens=max_tokens, seed=1)
    gen.generate_multiturn(prompts, KeyValueEnv, **kw)        # warm-up (and fills the prefix cache)
    out = {}
    for name, deltas in (("full_resend", False), ("delta", True)):
        t = time.perf_counter()
        ro = gen.generate_multiturn(prompts, KeyValueEnv, route_deltas=deltas, **kw)
        out[name] = {"s": time.perf_counter() - t, "bytes": ro.meta["route_bytes"]["delta"],
                     "routes": ro.routes, "turns": ro.num_turns.tolist(),
                     "tokens": int(ro.prompt_lens.sum() + ro.response_lens.sum())}
    same = out["delta"]["routes"] == out["full_resend"]["routes"]
    per_turn = []   # cumulative bytes after each turn, one trajectory (resend: Σ of prefixes)
    ro = gen.generate_multiturn(prompts[:1], KeyValueEnv, **kw)
    row = ro.routes.num_layers * ro.routes.k * ro.routes.values.itemsize
    ends = [int(ro.prompt_lens[0]) + int(np.flatnonzero(ro.turns <= t)[-1]) for t in range(int(ro.num_turns[0]))]
    cum_d = [e * row for e in ends]
    cum_f = list(np.cumsum([e * row for e in ends]))
    per_turn = {"delta": cum_d, "full_resend": [int(x) for x in cum_f]}
    return {"turns": turns, "trajectories": trajectories, "max_tokens": max_tokens,
            "prompt_len": prompt_len, "same_routes": bool(same),
            "bytes_delta": out["delta"]["bytes"], "bytes_full": out["full_resend"]["bytes"],
            "bytes_ratio": out["delta"]["bytes"] / out["full_resend"]["bytes"],
            "s_delta": out["delta"]["s"], "s_full": out["full_resend"]["s"],
            "time_ratio": out["delta"]["s"] / out["full_resend"]["s"],
            "tokens": out["delta"]["tokens"], "turns_done": out["delta"]["turns"],
            "cumulative_bytes_one_trajectory": per_turn}


def _synthetic(n_tokens: int, turns: int, seed: int = 0):
    """Trajectories of ``turns`` turns (observation 8 tokens, model 24), logprobs with a small gap."""
    rng = np.random.default_rng(seed)
    seg = np.r_[np.zeros(8, bool), np.ones(24, bool)]
    per_row = turns * seg.size
    rows = max(n_tokens // per_row, 1)
    mask = np.tile(seg, turns * rows)
    turn = np.tile(np.repeat(np.arange(turns, dtype=np.int32), seg.size), rows)
    rl = np.where(mask, -rng.random(mask.size).astype(np.float32) * 3, np.nan).astype(np.float32)
    tl = np.where(mask, np.minimum(rl + rng.normal(0, 1e-3, mask.size).astype(np.float32), 0),
                  np.nan).astype(np.float32)
    cu = np.arange(rows + 1, dtype=np.int64) * per_row
    return tl, rl, mask, turn, cu


def gap_turn_cost(n_tokens: int = 4_000_000, turns: int = 10, reps: int = 3):
    from skyrl_numerics.gap import measure

    tl, rl, mask, turn, cu = _synthetic(n_tokens, turns)
    whole = best(lambda: measure(tl, rl, mask, cu_seqlens=cu), reps)
    per = best(lambda: measure(tl, rl, mask, cu_seqlens=cu, turns=turn), reps)
    return {"tokens": int(mask.size), "turns": turns, "s_whole": whole, "s_per_turn": per,
            "ratio": per / whole}


# ---- pytest-benchmark -----------------------------------------------------------------------
def test_gap_per_turn_cost(benchmark):
    from skyrl_numerics.gap import measure

    tl, rl, mask, turn, cu = _synthetic(1_000_000, 10)
    rep = benchmark(lambda: measure(tl, rl, mask, cu_seqlens=cu, turns=turn))
    assert len(rep.per_turn) == 10


def _plot(path: Path, res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = res["engine"]["cumulative_bytes_one_trajectory"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for k, lab in (("full_resend", "full prefix every turn"), ("delta", "turn deltas (RouteTrace)")):
        ax.plot(range(1, len(c[k]) + 1), np.asarray(c[k]) / 1e3, marker="o", label=lab)
    ax.set_xlabel("turn"); ax.set_ylabel("route kB shipped (cumulative)")
    ax.set_title("R3 routes of one trajectory, real vLLM CPU engine (tiny Qwen3-MoE)")
    ax.legend(); fig.tight_layout(); fig.savefig(path, dpi=110); plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=4_000_000)
    ap.add_argument("--out", default="artifacts/bench_multiturn")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from skyrl_numerics.engine.quiet import EngineLog

    res = {"gap": gap_turn_cost(a.tokens, a.turns)}
    with EngineLog() as elog:       # vLLM's output to OUT/vllm.log
        res["engine"] = engine_routes(a.turns)
        elog.keep(out / "vllm.log")
    e, g = res["engine"], res["gap"]
    print("| measure | deltas | full resend | ratio |\n|---|---|---|---|")
    print(f"| route bytes, {e['trajectories']} trajectories × {e['turns']} turns | {e['bytes_delta']:,} | "
          f"{e['bytes_full']:,} | {e['bytes_ratio']:.3f} |")
    print(f"| generate_multiturn wall s | {e['s_delta']:.2f} | {e['s_full']:.2f} | {e['time_ratio']:.2f} |")
    print(f"same routes: {e['same_routes']}")
    print(f"\n| gap.measure, {g['tokens']:,} tokens, {g['turns']} turns | whole only | + per turn | ratio |"
          f"\n|---|---|---|---|\n| s | {g['s_whole']:.3f} | {g['s_per_turn']:.3f} | {g['ratio']:.2f} |")
    (out / "bench_multiturn.json").write_text(json.dumps(res, indent=1))
    _plot(out / "bench_multiturn.png", res)
    print(f"wrote {out / 'bench_multiturn.json'}, {out / 'bench_multiturn.png'}")


if __name__ == "__main__":
    main()
