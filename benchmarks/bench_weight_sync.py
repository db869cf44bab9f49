"""Delta weight sync benchmarks: delta size, encode / apply throughput. Ratios vs zstd level 1.

A bf16 weight ``W ~ N(0, 0.02)`` (``--elements`` of them) takes a training-like step: a fraction
``f`` of its elements (1 % and 3 %, the range SkyRL reports per RL step) moves by 1-3 bf16 ulps
(a relative change of ~0.4-2 %), the rest is bit-identical, as in bf16 weights after one small
optimizer step. Measured in one process:

1. delta bytes / full bf16 bytes, with and without the byte shuffle, next to a full snapshot and
   a sparse (int32 index + bf16 value) encoding;
2. encode: ``DeltaPublisher.publish`` of a step (XOR, shuffle, zstd-1, two xxh3-128 digests,
   atomic file writes, update of the XOR base) vs ``zstd -1`` of the new raw bytes;
   apply: ``DeltaReceiver.apply`` (read, verify, decompress, unshuffle, XOR, verify, copy in) vs
   ``zstd -1`` decompression of those raw bytes (into a reused buffer). Steady state: the
   publisher and receiver have seen a step before (their buffers are warm), as in an RL loop.
   Ratio = baseline time / ours (> 1: faster than zstd-1 alone).
3. object-store latency (simulated: 20 ms per payload request): publish + apply of a 64-tensor
   delta with one request at a time vs ``io_workers=8`` in flight.

Files go to ``/dev/shm`` when it exists, so the file system is not what is timed. The vLLM
update-vs-restart timing is ``benchmarks/bench_engine_update.py``.

Run as a script for the markdown table (``python benchmarks/bench_weight_sync.py [--quick]``) or
under pytest-benchmark (``pytest benchmarks/bench_weight_sync.py --benchmark-only``).
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np
import torch

from skyrl_numerics.sync.weight_sync import DeltaPublisher, DeltaReceiver
from skyrl_numerics.sync.codec import Zstd, tensor_bytes
from skyrl_numerics.sync.store import SyncStore


def _best(fn, repeat=3):
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _tmpdir():
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    return tempfile.mkdtemp(prefix="bench_ws_", dir=shm)


def weights(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (0.02 * torch.randn(n, generator=g)).bfloat16()


def training_step(w: torch.Tensor, frac: float, seed: int = 1) -> torch.Tensor:
    """Move ``frac`` of the elements by +-1..3 bf16 ulps (bit-pattern steps), keep the rest."""
    rng = np.random.default_rng(seed)
    out = w.clone()
    bits = out.view(torch.int16)
    idx = torch.from_numpy(rng.choice(w.numel(), int(frac * w.numel()), replace=False))
    step = torch.from_numpy(rng.integers(1, 4, idx.numel()) * rng.choice([-1, 1], idx.numel()))
    bits[idx] = (bits[idx].to(torch.int32) + step.to(torch.int32)).to(torch.int16)
    return out


def delta_sizes(n: int, fracs=(0.01, 0.03)) -> list[dict]:
    w0 = weights(n)
    full_bytes = w0.numel() * 2
    rows = []
    for frac in fracs:
        w1 = training_step(w0, frac)
        changed = int((w1.view(torch.int16) != w0.view(torch.int16)).sum())
        row = dict(frac=frac, changed_frac=changed / n, full_bf16_bytes=full_bytes)
        for shuf in (True, False):
            root = _tmpdir()
            try:
                pub = DeltaPublisher(root, use_shuffle=shuf)
                snap = pub.publish({"w": w0})
                m = pub.publish({"w": w1})
            finally:
                shutil.rmtree(root)
            key = "shuffle" if shuf else "noshuffle"
            row[f"delta_over_full_{key}"] = m.payload_nbytes / full_bytes
            row[f"snapshot_over_full_{key}"] = snap.payload_nbytes / full_bytes
        row["sparse_idx_value_over_full"] = changed * 6 / full_bytes
        rows.append(row)
    return rows


def throughput(n: int, frac: float = 0.01, repeat: int = 3) -> dict:
    """Steady-state publish / apply of delta steps vs zstd-1 compress / decompress of the raw
    new bytes. The publisher alternates ``w1, w0, w1, ...`` (every step a delta of ``frac``);
    the receiver applies each; best of ``repeat`` each, after one warm-up step."""
    w0, w1 = weights(n), training_step(weights(n), frac)
    raw = tensor_bytes(w1)
    z = Zstd(1)
    t_zc = _best(lambda: z.compress(raw), repeat)
    blob = z.compress(raw)
    out = np.empty(raw.size, dtype=np.uint8)
    t_zd = _best(lambda: z.decompress(blob, raw.size, out=out), repeat)

    root = _tmpdir()
    try:
        pub = DeltaPublisher(root, snapshot_every=10**6)
        rec = DeltaReceiver(root)
        pub.publish({"w": w0})
        rec.sync()
        enc, app = [], []
        for step in range(repeat + 1):
            w = w1 if step % 2 == 0 else w0
            t = time.perf_counter()
            m = pub.publish({"w": w})
            enc.append(time.perf_counter() - t)
            t = time.perf_counter()
            rec.apply(m.version)
            app.append(time.perf_counter() - t)
            assert torch.equal(rec.state["w"].view(torch.int16), w.view(torch.int16))
    finally:
        shutil.rmtree(root)
    t_enc, t_app = min(enc[1:]), min(app[1:])
    gb = raw.size / 1e9
    return dict(frac=frac, bytes=raw.size, zstd1_compress_GBps=gb / t_zc,
                zstd1_decompress_GBps=gb / t_zd, publish_GBps=gb / t_enc, apply_GBps=gb / t_app,
                encode_ratio_vs_zstd1=t_zc / t_enc, apply_ratio_vs_zstd1=t_zd / t_app)


class _LatencyStore(SyncStore):
    """A local store that waits ``latency`` seconds per payload request, like an object store's
    round trip (a simulation: the bytes still come from /dev/shm)."""

    latency = 0.02

    def read(self, rel, **kw):
        if rel.startswith("payloads/"):
            time.sleep(self.latency)
        return super().read(rel, **kw)

    def write(self, rel, data):
        if rel.startswith("payloads/"):
            time.sleep(self.latency)
        super().write(rel, data)


def latency_hiding(n_tensors: int = 64, elements: int = 1 << 16, latency: float = 0.02,
                   workers=(1, 8)) -> dict:
    """Publish + apply of one 3 % delta over ``n_tensors`` tensors with ``latency`` s per request:
    ``io_workers=1`` (one request at a time) vs more in flight."""
    _LatencyStore.latency = latency
    s0 = {f"layers.{i}.w": weights(elements, seed=i) for i in range(n_tensors)}
    s1 = {k: training_step(v, 0.03, seed=i) for i, (k, v) in enumerate(s0.items())}
    out = dict(tensors=n_tensors, latency_s=latency)
    for w in workers:
        root = _tmpdir()
        try:
            pub = DeltaPublisher(root, io_workers=w)
            pub.publish(s0)
            rec = DeltaReceiver(root, io_workers=w)
            rec.sync()
            pub.store, rec.store = _LatencyStore(root), _LatencyStore(root)
            t = time.perf_counter()
            m = pub.publish(s1)
            out[f"publish_s_workers{w}"] = time.perf_counter() - t
            t = time.perf_counter()
            rec.apply(m.version)
            out[f"apply_s_workers{w}"] = time.perf_counter() - t
        finally:
            shutil.rmtree(root)
    lo, hi = workers[0], workers[-1]
    out["publish_speedup"] = out[f"publish_s_workers{lo}"] / out[f"publish_s_workers{hi}"]
    out["apply_speedup"] = out[f"apply_s_workers{lo}"] / out[f"apply_s_workers{hi}"]
    return out


# ---- pytest-benchmark -----------------------------------------------------------------------
def test_bench_delta_sizes(benchmark):
    rows = delta_sizes(1 << 20)
    for r in rows:
        benchmark.extra_info.update({f"f{r['frac']}_{k}": v for k, v in r.items()})
    w0 = weights(1 << 20)
    w1 = training_step(w0, 0.01)
    benchmark(lambda: Zstd(1).compress(np.bitwise_xor(tensor_bytes(w0), tensor_bytes(w1))))


def test_bench_publish_apply_vs_zstd(benchmark):
    res = throughput(1 << 22, repeat=2)
    benchmark.extra_info.update(res)
    w0, w1 = weights(1 << 20), training_step(weights(1 << 20), 0.01)

    def publish_step():
        root = _tmpdir()
        try:
            pub = DeltaPublisher(root)
            pub.publish({"w": w0})
            pub.publish({"w": w1})
        finally:
            shutil.rmtree(root)

    benchmark(publish_step)


def test_bench_latency_hiding(benchmark):
    res = latency_hiding(n_tensors=16, latency=0.01)
    benchmark.extra_info.update(res)
    benchmark.pedantic(lambda: None, rounds=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4M elements instead of 32M")
    ap.add_argument("--elements", type=int, default=None)
    args = ap.parse_args()
    n = args.elements or ((1 << 22) if args.quick else (1 << 25))
    print(f"## Delta weight sync (bf16, {n:,} elements = {2 * n / 1e6:.0f} MB, torch "
          f"{torch.__version__}, {os.cpu_count()} CPUs)\n")
    print("| elements changed | delta / full bf16 (shuffle) | (no shuffle) | full snapshot / full "
          "bf16 | sparse idx+value / full |")
    print("|---|---|---|---|---|")
    for r in delta_sizes(n):
        print(f"| {100 * r['frac']:.0f} % | {100 * r['delta_over_full_shuffle']:.2f} % | "
              f"{100 * r['delta_over_full_noshuffle']:.2f} % | "
              f"{100 * r['snapshot_over_full_shuffle']:.1f} % | "
              f"{100 * r['sparse_idx_value_over_full']:.2f} % |")
    print("\n| elements changed | publish GB/s | zstd-1 compress GB/s | encode ratio (zstd-1 time "
          "/ publish time) | apply GB/s | zstd-1 decompress GB/s | apply ratio |")
    print("|---|---|---|---|---|---|---|")
    for frac in (0.01, 0.03):
        r = throughput(n, frac)
        print(f"| {100 * frac:.0f} % | {r['publish_GBps']:.2f} | {r['zstd1_compress_GBps']:.2f} | "
              f"{r['encode_ratio_vs_zstd1']:.2f} | {r['apply_GBps']:.2f} | "
              f"{r['zstd1_decompress_GBps']:.2f} | {r['apply_ratio_vs_zstd1']:.2f} |")
    r = latency_hiding()
    print(f"\n| {r['tensors']} tensors, {1e3 * r['latency_s']:.0f} ms per request (simulated) | "
          "io_workers=1 | io_workers=8 | speed-up |")
    print("|---|---|---|---|")
    for k in ("publish", "apply"):
        print(f"| {k} | {r[f'{k}_s_workers1']:.2f} s | {r[f'{k}_s_workers8']:.2f} s | "
              f"{r[f'{k}_speedup']:.1f}x |")


if __name__ == "__main__":
    main()
