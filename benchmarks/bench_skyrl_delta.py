"""SkyRL 0.4's checkpoint-delta layout vs ours: bytes per version and apply time (docs/weight_sync.md).

    .venv/bin/python benchmarks/bench_skyrl_delta.py [--repeat 5]

Weights: the tiny Qwen3-MoE test checkpoint (``build_tiny_model("qwen3_moe")``, bf16) and 8 bf16
``[1024, 1024]`` matrices ``N(0, 0.02)``. A training-like step moves the given share of elements by
1-3 bf16 ulps. Each step is published in SkyRL's layout (``SkyrlLayoutPublisher``: the same bytes
as SkyRL's own publisher, tests/integrations/test_skyrl_delta.py) and in ours (``DeltaPublisher``,
byte shuffle), and applied by ``SkyrlDeltaReceiver`` (prepare + commit: read, zstd, XOR, xxh3)
and, when ``<venv>/frameworks/skyrl`` holds SkyRL 0.4.0, by SkyRL's ``LocalCheckpointStore.fetch``
(mmap XOR of its checkpoint copy). Times: median of ``--repeat`` runs, this host.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import typing
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from skyrl_numerics.models import build_tiny_model
from skyrl_numerics.sync.skyrl_publisher import SkyrlLayoutPublisher
from skyrl_numerics.sync.skyrl_receiver import SkyrlDeltaReceiver
from skyrl_numerics.sync.weight_sync import DeltaPublisher


def step(state, frac, seed):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in state.items():
        if t.dtype != torch.bfloat16:
            out[k] = t
            continue
        flat = t.clone().reshape(-1)
        idx = torch.randperm(flat.numel(), generator=g)[: int(frac * flat.numel())]
        flat.view(torch.int16)[idx] += torch.randint(1, 4, (idx.numel(),), generator=g, dtype=torch.int16)
        out[k] = flat.reshape(t.shape)
    return out


def skyrl_store_cls():
    folder = Path(sys.prefix) / "frameworks" / "skyrl"
    if not (folder / "skyrl-0.4.0.dist-info").is_dir():
        return None
    import typing_extensions

    sys.path.insert(0, str(folder))
    typing.TypedDict = typing_extensions.TypedDict
    from skyrl.backends.skyrl_train.weight_sync.delta.checkpoint import LocalCheckpointStore

    return LocalCheckpointStore


def measure(name, base_dir, s0, frac, repeat, store_cls):
    raw = sum(t.numel() * t.element_size() for t in s0.values())
    s1 = step(s0, frac, 1)
    ours_t, skyrl_t = [], []
    with tempfile.TemporaryDirectory() as d:
        m = SkyrlLayoutPublisher(f"{d}/skyrl", base_dir).publish(s1)
        pub = DeltaPublisher(f"{d}/ours", snapshot_every=1000)
        pub.publish(s0)
        ours = pub.publish(s1)
        for i in range(repeat):
            r = SkyrlDeltaReceiver(f"{d}/skyrl", base_dir)
            t0 = time.perf_counter()
            r.commit(r.prepare(1))
            ours_t.append(time.perf_counter() - t0)
            if store_cls is not None:
                st = store_cls(str(base_dir), f"{d}/local{i}")
                t0 = time.perf_counter()
                st.fetch(target_version=1, sync_dir=f"{d}/skyrl")
                skyrl_t.append(time.perf_counter() - t0)
    sk = f"{statistics.median(skyrl_t) * 1e3:.1f} ms" if skyrl_t else "n/a"
    print(f"| {name} | {frac:.0%} | {raw} | {m.payload_nbytes} ({m.payload_nbytes / raw:.2%}) | "
          f"{ours.payload_nbytes} ({ours.payload_nbytes / raw:.2%}) | "
          f"{statistics.median(ours_t) * 1e3:.1f} ms | {sk} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    store_cls = skyrl_store_cls()
    print("| weights | elements moved | raw bytes | SkyRL layout payload | ours (shuffle) payload |"
          " apply, SkyrlDeltaReceiver | apply, SkyRL LocalCheckpointStore |")
    print("|---|---|---|---|---|---|---|")
    tiny = build_tiny_model("qwen3_moe")
    s_tiny = load_file(str(Path(tiny) / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    s_big = {f"model.layers.{i}.mlp.down_proj.weight": (torch.randn(1024, 1024, generator=g) * 0.02).bfloat16()
             for i in range(8)}
    with tempfile.TemporaryDirectory() as d:
        save_file(s_big, f"{d}/model.safetensors")
        for frac in (0.01, 0.03):
            measure("tiny Qwen3-MoE", tiny, s_tiny, frac, a.repeat, store_cls)
            measure("8 x [1024, 1024]", Path(d), s_big, frac, a.repeat, store_cls)


if __name__ == "__main__":
    main()
