"""Bytes per weight-sync step in serving formats vs bf16 (docs/weight_sync.md, BENCHMARKS.md).

    .venv/bin/python benchmarks/bench_sync_serving_format.py [--mats 8] [--dim 1024]

bf16 weights ``N(0, 0.02)``: ``--mats`` linear matrices ``[dim, dim]``; a training-like step moves
the given share of elements by 1-3 bf16 ulps. Each format is published by ``DeltaPublisher``
(version 0 full, then one delta per step) and its payload bytes are reported against the full bf16
bytes of the same weights (sizes are deterministic).
"""
from __future__ import annotations

import argparse
import tempfile

import torch

from skyrl_numerics.sync.weight_sync import DeltaPublisher

FORMATS = ("native", "deepseek_fp8", "ct_fp8_block", "ct_int4", "ct_nvfp4")


def step(state, frac, seed):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in state.items():
        flat = t.clone().reshape(-1)
        idx = torch.randperm(flat.numel(), generator=g)[: int(frac * flat.numel())]
        flat.view(torch.int16)[idx] += torch.randint(1, 4, (idx.numel(),), generator=g, dtype=torch.int16)
        out[k] = flat.reshape(t.shape)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mats", type=int, default=8)
    ap.add_argument("--dim", type=int, default=1024)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    s0 = {f"model.layers.{i}.mlp.down_proj.weight": (torch.randn(a.dim, a.dim, generator=g) * 0.02).bfloat16()
          for i in range(a.mats)}
    bf16 = sum(t.numel() * 2 for t in s0.values())
    print(f"{a.mats} x [{a.dim}, {a.dim}] bf16 = {bf16} bytes")
    print("| format | stored bytes / bf16 | full snapshot / bf16 | delta 1 % / bf16 | delta 3 % / bf16 |")
    print("|---|---|---|---|---|")
    for fmt in FORMATS:
        with tempfile.TemporaryDirectory() as d:
            pub = DeltaPublisher(d, weights_format=fmt, snapshot_every=1000)
            m0 = pub.publish(s0)
            m1 = pub.publish(step(s0, 0.01, 1))
            pub2 = DeltaPublisher(d + "/b", weights_format=fmt, snapshot_every=1000)
            pub2.publish(s0)
            m3 = pub2.publish(step(s0, 0.03, 3))
        print(f"| {fmt} | {m0.raw_nbytes / bf16:.1%} | {m0.payload_nbytes / bf16:.2%} | "
              f"{m1.payload_nbytes / bf16:.3%} | {m3.payload_nbytes / bf16:.3%} |")


if __name__ == "__main__":
    main()
