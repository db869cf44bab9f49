"""Replay benchmarks: route bytes, pack->serialize->load throughput, multi-turn deltas, support_logprobs.

Every number is a ratio against a baseline measured in the same process:

1. bytes per token of PackedRoutes vs int32 dense ``[T, L, k]`` and vs a padded ``[B, max_len, L, k]`` tensor.
2. pack -> serialize -> load throughput as a ratio to ``memcpy`` of the same (packed) bytes (goal >= 0.5).
3. a 10-turn trajectory's total route bytes, turn-only deltas vs resending the full prefix every turn.
4. support_logprobs (vocab-chunked) vs the full-vocab boolean-mask reference at vocab 151,936: time and
   peak extra memory (each run in a fresh subprocess, peak RSS over the inputs' RSS).
5. the load's digest check (``from_buffer(validate=False)``: header + xxh3-64 over the whole buffer) as a
   ratio to ``memcpy`` of the same bytes.

Run as a script for the markdown table (``python benchmarks/bench_replay.py [--quick]``) or under
pytest-benchmark (``pytest benchmarks/bench_replay.py --benchmark-only``).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

from skyrl_numerics.replay import PackedRoutes, RouteTrace

# Qwen3-30B-A3B routing shape: 48 MoE layers, top-8 of 128 experts
L, K, E = 48, 8, 128


def _best(fn, repeat=5):
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _lengths(B=64, seed=0, lo=256, hi=16384):
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(2000), 0.9, size=B).astype(np.int64), lo, hi)


# ---- 1. bytes per token ----------------------------------------------------------------------------
def bytes_per_token(num_experts=E, layers=L, k=K, B=64):
    lens = _lengths(B)
    T = int(lens.sum())
    r = PackedRoutes.empty(lens, layers, k, num_experts)
    r.values.fill(num_experts - 1)  # sizes do not depend on the ids; keep them valid for bit-packing
    packed = r.to_buffer().nbytes
    bitpacked = PackedRoutes(r.values, r.cu_seqlens, num_experts, validate=False).to_buffer(bitpack=True).nbytes
    dense32 = T * layers * k * 4
    padded32 = B * int(lens.max()) * layers * k * 4
    return dict(experts=num_experts, tokens=T, seqs=B, max_len=int(lens.max()),
                packed_B_per_tok=packed / T, bitpacked_B_per_tok=bitpacked / T,
                int32_dense_B_per_tok=dense32 / T, int32_padded_B_per_tok=padded32 / T,
                ratio_dense_over_packed=dense32 / packed, ratio_padded_over_packed=padded32 / packed,
                ratio_dense_over_bitpacked=dense32 / bitpacked)


# ---- 2. pack -> serialize -> load vs memcpy -----------------------------------------------------------
def _capture_like(lens, dtype, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, E, size=(int(n), L, K)).astype(dtype) for n in lens]


def pipeline(seqs, validate_load=True):
    r = PackedRoutes.from_sequences(seqs, E)      # pack (ids checked), straight into the final buffer
    buf = r.to_buffer()                           # serialize: the buffer itself
    back = PackedRoutes.from_buffer(buf, validate=validate_load)  # load: header + views (+ validation)
    return back


def pipeline_throughput(B=16, src_dtype=np.uint8, repeat=5):
    lens = _lengths(B, lo=256, hi=4096)
    seqs = _capture_like(lens, src_dtype)
    nbytes = PackedRoutes.from_sequences(seqs, E).to_buffer().nbytes
    src = np.random.default_rng(2).integers(0, 255, size=nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    t_copy = _best(lambda: np.copyto(dst, src), repeat)       # into a preallocated, touched buffer
    t_alloc = _best(lambda: src.copy(), repeat)               # allocate + copy, like any fresh buffer
    t_pipe = _best(lambda: pipeline(seqs), repeat)
    t_trusted = _best(lambda: pipeline(seqs, validate_load=False), repeat)  # ids already checked at pack
    return dict(source=np.dtype(src_dtype).name, MB=nbytes / 1e6, memcpy_GBps=nbytes / t_copy / 1e9,
                pipeline_GBps=nbytes / t_pipe / 1e9, ratio_to_memcpy=t_copy / t_pipe,
                ratio_to_alloc_copy=t_alloc / t_pipe, ratio_unvalidated_load=t_copy / t_trusted)


def digest_check(tokens=1 << 16, repeat=5):
    """``from_buffer(buf, validate=False)`` (header checks + the xxh3-64 digest of the whole buffer, no id
    check) vs ``memcpy`` of the same bytes into a preallocated buffer; ratio > 1: the check is faster."""
    r = PackedRoutes.from_sequences([np.random.default_rng(4).integers(0, E, (tokens, L, K), dtype=np.uint8)], E)
    buf = r.to_buffer()
    dst = np.empty_like(buf)
    t_copy = _best(lambda: np.copyto(dst, buf), repeat)
    t_load = _best(lambda: PackedRoutes.from_buffer(buf, validate=False), repeat)
    return dict(MB=buf.nbytes / 1e6, memcpy_GBps=buf.nbytes / t_copy / 1e9, digest_check_GBps=buf.nbytes / t_load / 1e9,
                ratio_to_memcpy=t_copy / t_load)


# ---- 3. multi-turn ---------------------------------------------------------------------------------
def multi_turn(turns=10, prompt=1024, user=256, response=1024):
    """Engine rows per turn: turn 1 runs prompt + response - 1 positions; each later turn runs the previous
    final token + user + response - 1 = user + response positions. Full-prefix resend ships all rows so far."""
    rng = np.random.default_rng(3)
    tr = RouteTrace(L, K, E)
    full_bytes = 0
    for t in range(turns):
        n = prompt + response - 1 if t == 0 else user + response
        tr.add(rng.integers(0, E, size=(n, L, K), dtype=np.uint8))
        full_bytes += PackedRoutes.empty([tr.num_tokens], L, K, E).to_buffer().nbytes  # whole prefix this turn
    delta_bytes = tr.nbytes + turns * 64  # each delta shipped with a 64-byte header
    final = tr.to_routes()
    return dict(turns=turns, trajectory_rows=tr.num_tokens, delta_total_bytes=delta_bytes,
                full_prefix_total_bytes=full_bytes, ratio_full_over_delta=full_bytes / delta_bytes,
                final_routes_bytes=final.to_buffer().nbytes)


# ---- 4. support_logprobs -----------------------------------------------------------------------------
_CHILD = r"""
import json, resource, sys, time, numpy as np, torch
from skyrl_numerics.replay import PackedSupport, support_logprobs, support_logprobs_reference
method, N, H, V, ksup, chunk = sys.argv[1], *map(int, sys.argv[2:7])
torch.manual_seed(0)
hidden = torch.empty(N, H).normal_(); W = torch.empty(V, H).normal_(std=0.05)  # in place: no setup peak
rng = np.random.default_rng(0)
sets = [rng.choice(V, size=ksup, replace=False) for _ in range(N)]
targets = torch.tensor([int(s[0]) for s in sets]); sup = PackedSupport.from_sets(sets, V)
def run():
    if method == "dense_mask":
        return support_logprobs_reference(hidden, W, targets, sup)
    return support_logprobs(hidden, W, targets, sup, chunk=chunk, method=method)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter(); out = run(); dt = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t2 = time.perf_counter(); run(); dt = min(dt, time.perf_counter() - t2)
print(json.dumps(dict(seconds=dt, peak_extra_MB=(peak - base) / 1024, lp0=float(out[0][0]))))
"""


def _child(method, N, H, V, ksup, chunk):
    out = subprocess.run([sys.executable, "-c", _CHILD, method, str(N), str(H), str(V), str(ksup), str(chunk)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def support_memory(N=256, H=1024, V=151936, ksup=64, chunk=8192):
    """Rows: the dense boolean-mask reference (baseline), vocab-chunked dense, and auto (sparse for small supports)."""
    base = _child("dense_mask", N, H, V, ksup, chunk)
    rows = []
    for method in ("dense", "auto"):
        c = _child(method, N, H, V, ksup, chunk)
        rows.append(dict(tokens=N, hidden=H, vocab=V, support=ksup, method=method, seconds=c["seconds"],
                         mask_seconds=base["seconds"], speedup_vs_mask=base["seconds"] / c["seconds"],
                         peak_extra_MB=c["peak_extra_MB"], mask_peak_extra_MB=base["peak_extra_MB"],
                         mem_ratio_mask_over_this=base["peak_extra_MB"] / max(c["peak_extra_MB"], 1.0),
                         same_lp=abs(c["lp0"] - base["lp0"]) < 1e-3))
    return rows


# ---- pytest-benchmark ------------------------------------------------------------------------------
def test_bench_pipeline_vs_memcpy(benchmark):
    lens = _lengths(8, lo=256, hi=4096)
    seqs = _capture_like(lens, np.uint8)
    res = pipeline_throughput(B=8)
    benchmark.extra_info.update(res)
    back = benchmark(pipeline, seqs)
    assert back.num_tokens == int(lens.sum())


def test_bench_digest_check_vs_memcpy(benchmark):
    res = digest_check(tokens=1 << 14, repeat=3)
    benchmark.extra_info.update(res)
    buf = PackedRoutes.from_sequences([np.zeros((1 << 14, L, K), np.uint8)], E).to_buffer()
    back = benchmark(PackedRoutes.from_buffer, buf, validate=False)
    assert back.num_tokens == 1 << 14


def test_bench_bytes_and_turns(benchmark):
    benchmark.extra_info.update({f"bytes_{k}": v for k, v in bytes_per_token().items()})
    benchmark.extra_info.update({f"turns_{k}": v for k, v in multi_turn().items()})
    benchmark(lambda: bytes_per_token(B=8))


def test_bench_support_logprobs_small_vocab(benchmark):
    import torch

    from skyrl_numerics.replay import PackedSupport, support_logprobs, support_logprobs_reference

    N, H, V = 64, 256, 32768
    hidden, W = torch.randn(N, H), torch.randn(V, H) * 0.05
    rng = np.random.default_rng(0)
    sets = [rng.choice(V, size=64, replace=False) for _ in range(N)]
    targets = torch.tensor([int(s[0]) for s in sets])
    sup = PackedSupport.from_sets(sets, V)
    t_ref = _best(lambda: support_logprobs_reference(hidden, W, targets, sup), 3)
    t_chk = _best(lambda: support_logprobs(hidden, W, targets, sup, chunk=4096), 3)
    benchmark.extra_info.update(dense_mask_s=t_ref, chunked_s=t_chk, ratio_dense_over_chunked=t_ref / t_chk)
    benchmark(support_logprobs, hidden, W, targets, sup, chunk=4096)


# ---- script ----------------------------------------------------------------------------------------
def _table(title, rows):
    keys = list(rows[0])
    lines = [f"### {title}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in r.values()) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (seconds), for CI smoke runs")
    a = ap.parse_args(argv)
    out = [_table("Route bytes per token (Qwen3-30B-A3B shape: 48 MoE layers, top-8)",
                  [bytes_per_token(e) for e in (128, 256, 512)])]
    out.append(_table("pack -> serialize -> load vs memcpy of the same bytes",
                      [pipeline_throughput(B=4 if a.quick else 16, src_dtype=dt, repeat=3 if a.quick else 7)
                       for dt in (np.uint8, np.int32)]))
    out.append(_table("load's digest check (from_buffer, validate=False) vs memcpy of the same bytes",
                      [digest_check(tokens=1 << 12 if a.quick else 1 << 16, repeat=3 if a.quick else 7)]))
    out.append(_table("10-turn trajectory: turn-only deltas vs full prefix every turn",
                      [multi_turn(), multi_turn(response=256, user=64)]))
    sm = dict(N=32, H=256, V=151936) if a.quick else dict(N=256, H=1024, V=151936)
    out.append(_table("support_logprobs vs full-vocab boolean mask (dense logits + mask), vocab 151,936",
                      [row for k in (64, 4096) for row in support_memory(**sm, ksup=k)]))
    print("\n".join(out))


if __name__ == "__main__":
    main()
