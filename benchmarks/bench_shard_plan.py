"""Sharded weight transfer (``sync/shard_plan.py``, ``sharded.py``): bytes each engine rank
receives with the plan vs a full gather, plan-build time, and — from the same planner on the real
layouts of a 1T-parameter MoE — the bytes per link and the time at stated link bandwidths.

pytest-benchmark (same process, a ratio against the baseline):

    .venv/bin/python -m pytest benchmarks/bench_shard_plan.py --benchmark-only -q -s

  ``test_apply_sharded_vs_full``: megatron TP2 x EP2 (4 ranks) -> vLLM TP2, a Qwen3-MoE of 4 layers,
  hidden 1024, 32 experts of 512: every engine rank filled from the plan's blocks vs from every HF
  tensor it touches whole (what a full gather delivers), time and bytes.

Script (the scale-out table in BENCHMARKS.md; progress on stderr, JSON + PNG to --out):

    .venv/bin/python benchmarks/bench_shard_plan.py --model kimi_k2 --out artifacts/shard_plan

Assumptions of the scale-out estimate (written into the JSON):
- 48 nodes x 8 GPUs; trainer = megatron-core on all 384 GPUs (default TP8 x PP8 x EP48: expert
  data parallel 1, dense data parallel 6); engines = 12 colocated vLLM replicas of TP8 x DP4 with
  expert parallelism (32 GPUs each, replica k on GPUs 32k..32k+31), BF16 weights.
- A block the destination's own GPU already holds is a local copy (not counted as sent).
- Links: NVLink 450 GB/s per GPU per direction inside a node; 50 GB/s per GPU per direction between
  nodes (one 400 Gb/s NIC per GPU); full duplex; NVLink and the NIC run at once. The time is the
  busiest GPU's max(bytes / bandwidth) over its four directions: a lower bound (no latency,
  congestion, or the engine's own load and re-processing time).
- Full gather (the baselines): every engine rank receives (a) every HF tensor it touches whole, or
  (b) the whole model, all of it over its NIC.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import pytest
import torch

from skyrl_numerics.sync import shard_layouts as sl
from skyrl_numerics.sync import shard_plan as sp
from _timing import best

MODELS = {
    # config.json fields of the public checkpoints (the layer dims; nothing is downloaded)
    "kimi_k2": dict(hidden_size=7168, num_hidden_layers=61, first_k_dense_replace=1,
                    intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=384,
                    n_shared_experts=1, num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512,
                    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=163840,
                    tie_word_embeddings=False),
    "deepseek_v3": dict(hidden_size=7168, num_hidden_layers=61, first_k_dense_replace=3,
                        intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256,
                        n_shared_experts=1, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280,
                        tie_word_embeddings=False),
}
NVLINK_GBS, NIC_GBS, GPUS_PER_NODE = 450.0, 50.0, 8


# ---- pytest-benchmark ------------------------------------------------------------------------------
def _mid_config():
    from skyrl_numerics.models import tiny_config

    return tiny_config("qwen3_moe", num_hidden_layers=4, hidden_size=1024, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=128, num_experts=32, moe_intermediate_size=512,
                       vocab_size=8192)




@pytest.mark.megatron
def test_apply_sharded_vs_full(benchmark):
    cfg = _mid_config()
    g = torch.Generator().manual_seed(0)
    hf = {k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in sl.hf_shapes(cfg).items()}
    src, dst = sl.megatron_layout(cfg, tp=2, ep=2, world=4), sl.vllm_layout(cfg, tp=2)
    t0 = time.perf_counter()
    p = sp.plan(src, dst)
    build = time.perf_counter() - t0
    have = sp.materialize(src, hf)
    out = {r: {k: torch.empty_like(v) for k, v in d.items()} for r, d in sp.materialize(dst, hf).items()}
    touched = {}
    for q in dst.pieces:
        touched.setdefault(q.rank, set()).add(q.hf)

    def full():          # every HF tensor a rank touches arrives whole, then the rank cuts its layout
        for r in out:
            got = {h: hf[h].clone() for h in touched[r]}
            sp.materialize(sp.Layout(dst.name, dst.world, dst.hf_shapes,
                                     [q for q in dst.pieces if q.rank == r], dst.shapes), got)

    base = best(full)
    benchmark.pedantic(lambda: sp.execute(p, have, out), rounds=3, iterations=1)
    ours = best(lambda: sp.execute(p, have, out))
    recv, fullb = p.received(local=True), p.full_bytes()
    benchmark.extra_info.update({
        "full_over_sharded_time": round(base / ours, 2), "plan_build_s": round(build, 4),
        "received_over_full_bytes": round(sum(recv.values()) / sum(fullb.values()), 3)})
    print(f"\napply: sharded {ours * 1e3:.1f} ms vs full gather {base * 1e3:.1f} ms "
          f"({base / ours:.2f}x); bytes per engine rank {recv} vs full {fullb}; plan {build * 1e3:.0f} ms")


# ---- the scale-out estimate --------------------------------------------------------------------------
def estimate(model: str, *, nodes: int = 48, tp: int = 8, pp: int = 8, ep: int = 48,
             engine_tp: int = 8, engine_dp: int = 4, progress=print) -> dict:
    cfg = dict(MODELS[model])
    world = nodes * GPUS_PER_NODE
    shapes = sl.hf_shapes(cfg)
    model_bytes = sum(math.prod(s) for s in shapes.values()) * 2
    t0 = time.perf_counter()
    src = sl.megatron_layout(cfg, tp=tp, ep=ep, pp=pp, world=world)
    dst = sl.vllm_layout(cfg, tp=engine_tp, dp=engine_dp, ep=True)
    layouts_s = time.perf_counter() - t0
    per = dst.world
    if world % per:
        raise SystemExit(f"{world} GPUs do not hold whole engine replicas of {per}")
    dirs = {g: [0, 0, 0, 0] for g in range(world)}   # send NVLink, recv NVLink, send NIC, recv NIC
    local = sent = 0
    load: dict = {}
    t0 = time.perf_counter()
    full_touched = 0
    for k in range(world // per):
        p = sp.plan(src, dst, colocate_offset=k * per, load=load)
        if k == 0:
            full_touched = max(p.full_bytes().values())
        for t in p.transfers:
            s, d, n = t.src_rank, t.dst_rank + k * per, t.numel * 2
            if s == d:
                local += n
                continue
            sent += n
            intra = s // GPUS_PER_NODE == d // GPUS_PER_NODE
            dirs[s][0 if intra else 2] += n
            dirs[d][1 if intra else 3] += n
        progress(f"replica {k + 1}/{world // per} planned ({time.perf_counter() - t0:.0f} s)")
    plan_s = time.perf_counter() - t0

    def busiest(i, bw):
        return max(v[i] for v in dirs.values()) / (bw * 1e9)

    t_sharded = max(busiest(0, NVLINK_GBS), busiest(1, NVLINK_GBS), busiest(2, NIC_GBS), busiest(3, NIC_GBS))
    recv = [v[1] + v[3] for v in dirs.values()]
    return {
        "model": model, "params_b": round(model_bytes / 2 / 1e9, 1), "model_bytes": model_bytes,
        "gpus": world, "trainer": f"megatron TP{tp} x PP{pp} x EP{ep}",
        "engine": f"{world // per} replicas of vLLM TP{engine_tp} x DP{engine_dp} + EP",
        "bandwidth_gbs": {"nvlink_per_gpu_dir": NVLINK_GBS, "nic_per_gpu_dir": NIC_GBS},
        "bytes_sent_total": sent, "bytes_local_total": local,
        "busiest_gpu_bytes": {"send_nvlink": max(v[0] for v in dirs.values()),
                              "recv_nvlink": max(v[1] for v in dirs.values()),
                              "send_nic": max(v[2] for v in dirs.values()),
                              "recv_nic": max(v[3] for v in dirs.values())},
        "engine_rank_received_max": max(recv), "engine_rank_received_mean": sum(recv) / len(recv),
        "t_sharded_s": t_sharded,
        "full_touched_bytes_per_rank": full_touched, "t_full_touched_s": full_touched / (NIC_GBS * 1e9),
        "full_model_bytes_per_rank": model_bytes, "t_full_model_s": model_bytes / (NIC_GBS * 1e9),
        "layouts_s": round(layouts_s, 1), "plan_s": round(plan_s, 1),
        "skyrl_reported_s": 7.53 if model == "kimi_k2" else None,
    }


def _png(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["sharded plan\n(busiest GPU)", "full gather,\ntensors touched", "full gather,\nwhole model"]
    secs = [res["t_sharded_s"], res["t_full_touched_s"], res["t_full_model_s"]]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    bars = ax.bar(labels, secs, color=["tab:green", "tab:orange", "tab:red"])
    for b, s in zip(bars, secs):
        ax.text(b.get_x() + b.get_width() / 2, s, f"{s:.1f} s", ha="center", va="bottom")
    if res.get("skyrl_reported_s"):
        ax.axhline(res["skyrl_reported_s"], ls="--", color="gray")
        ax.text(2.4, res["skyrl_reported_s"], "SkyRL reported 7.53 s", ha="right", va="bottom", color="gray")
    ax.set_ylabel("seconds (lower bound from bytes / link speed)")
    ax.set_title(f"{res['model']} ({res['params_b']} B params, BF16) on {res['gpus']} GPUs")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="kimi_k2")
    ap.add_argument("--nodes", type=int, default=48)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=8)
    ap.add_argument("--ep", type=int, default=48)
    ap.add_argument("--engine-tp", type=int, default=8)
    ap.add_argument("--engine-dp", type=int, default=4)
    ap.add_argument("--out", default="artifacts/shard_plan")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    from skyrl_numerics.errors import InputError

    try:
        res = estimate(a.model, nodes=a.nodes, tp=a.tp, pp=a.pp, ep=a.ep, engine_tp=a.engine_tp,
                       engine_dp=a.engine_dp, progress=lambda m: print(m, file=sys.stderr, flush=True))
    except InputError as e:
        print(f"bench_shard_plan: {e}", file=sys.stderr)
        return 2
    stem = os.path.join(a.out, f"{a.model}")
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=1)
    _png(res, stem + ".png")
    gb = 1e9
    print(f"{res['model']}: {res['params_b']} B params, {res['gpus']} GPUs, {res['trainer']} -> {res['engine']}")
    print(f"  sharded: busiest GPU receives {res['engine_rank_received_max'] / gb:.1f} GB "
          f"(NIC {res['busiest_gpu_bytes']['recv_nic'] / gb:.1f} GB), sends NIC "
          f"{res['busiest_gpu_bytes']['send_nic'] / gb:.1f} GB -> {res['t_sharded_s']:.2f} s")
    print(f"  full gather, tensors touched: {res['full_touched_bytes_per_rank'] / gb:.1f} GB per rank -> "
          f"{res['t_full_touched_s']:.1f} s; whole model {res['model_bytes'] / gb:.0f} GB -> "
          f"{res['t_full_model_s']:.1f} s")
    print(f"  layouts {res['layouts_s']} s, plans {res['plan_s']} s; {stem}.json, {stem}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
