"""gap.measure on 10M tokens vs one numpy pass ``np.abs(a - b).mean()`` over the same arrays.

Goal (issue 14): the full report <= 3x that single pass. Both are timed in the same process on
the same float32 arrays, interleaved (baseline, measure, baseline, measure, ...) over several
rounds; the reported numbers are medians (times and per-round ratios), wall clock and process
CPU time (all threads; steadier when other work shares the cores).

Layouts: flat + cu_seqlens with short (1..2000) and long (2K..16K, RL-reasoning-like) responses,
padded [B, 2000] with a right-padding mask (baseline over the masked tokens only, already
compacted), and the plain full-array reference path (``measure_reference``) for scale.
``measure`` uses its default scan (compiled with numba when it imports) and default threads (up
to 8, at most ``os.cpu_count()``); the ``threads=1`` row shows the single-core cost; ``numpy:``
rows run the pure-numpy fallback scan (``SKYRL_NUMERICS_NUMBA=0``; bitwise-equal report).

Tokens: ``SKYRL_BENCH_GAP_TOKENS`` (default 10_000_000), rounds: ``SKYRL_BENCH_GAP_ROUNDS``
(default 7). Run as a script for a markdown table (``python benchmarks/bench_gap.py``) or under
pytest-benchmark (``pytest benchmarks/bench_gap.py --benchmark-only``).
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

from skyrl_numerics.gap import measure, measure_reference

N = int(os.environ.get("SKYRL_BENCH_GAP_TOKENS", 10_000_000))
MAX_LEN = 2000


def make_data(n=N, seed=0):
    """float32 logprobs with a bf16-like gap (σ 1e-3), 20 % of tokens bitwise equal."""
    rng = np.random.default_rng(seed)
    b = (-rng.exponential(1.0, n)).astype(np.float32)
    a = np.minimum(b + rng.normal(0, 1e-3, n).astype(np.float32), 0).astype(np.float32)
    eq = rng.random(n) < 0.2
    a[eq] = b[eq]
    lens = rng.integers(1, MAX_LEN, n // (MAX_LEN // 2) + 2)
    cu = np.concatenate([[0], np.cumsum(lens)])
    cu = np.append(cu[cu < n], n)
    long_lens = rng.integers(2048, 16384, n // 2048 + 2)
    cu_long = np.concatenate([[0], np.cumsum(long_lens)])
    cu_long = np.append(cu_long[cu_long < n], n)
    rows = n // MAX_LEN
    pa, pb = a[: rows * MAX_LEN].reshape(rows, MAX_LEN), b[: rows * MAX_LEN].reshape(rows, MAX_LEN)
    pm = np.arange(MAX_LEN)[None, :] < rng.integers(1, MAX_LEN + 1, rows)[:, None]
    return a, b, cu, pa, pb, pm, cu_long


def _best(fn, repeat=5, clock=time.perf_counter):
    best = float("inf")
    for _ in range(repeat):
        t = clock()
        fn()
        best = min(best, clock() - t)
    return best


def baseline(a, b):
    return np.abs(a - b).mean()


def _timed(fn, clock):
    t = clock()
    fn()
    return clock() - t


def cases():
    a, b, cu, pa, pb, pm, cu_long = make_data()
    ca, cb = pa[pm], pb[pm]
    out = []
    for tag, kw in (("", {}), ("numpy: ", {"_kernel": "numpy"})):
        out += [
            (f"{tag}flat + cu_seqlens, short seqs", lambda kw=kw: measure(a, b, cu_seqlens=cu, **kw), (a, b)),
            (f"{tag}flat + cu_seqlens, short seqs, threads=1",
             lambda kw=kw: measure(a, b, cu_seqlens=cu, threads=1, **kw), (a, b)),
            (f"{tag}flat + cu_seqlens, long seqs", lambda kw=kw: measure(a, b, cu_seqlens=cu_long, **kw), (a, b)),
            (f"{tag}padded [B, 2000] + mask", lambda kw=kw: measure(pa, pb, pm, **kw), (ca, cb)),
        ]
    out.append(("reference (full arrays)", lambda: measure_reference(a, b, cu_seqlens=cu), (a, b)))
    return out


def rows(rounds=None):
    rounds = rounds or int(os.environ.get("SKYRL_BENCH_GAP_ROUNDS", 7))
    out = []
    for name, fn, (ba, bb) in cases():
        fn()  # warm up (first use of the compiled scan in a process loads it from numba's cache)
        rr = 2 if "reference" in name else rounds
        res = {"wb": [], "wm": [], "cb": [], "cm": []}
        for _ in range(rr):
            for key, f, clock in (("wb", lambda: baseline(ba, bb), time.perf_counter), ("wm", fn, time.perf_counter),
                                  ("cb", lambda: baseline(ba, bb), time.process_time), ("cm", fn, time.process_time)):
                res[key].append(_timed(f, clock))
        med = {k: float(np.median(v)) for k, v in res.items()}
        out.append(dict(case=name, tokens=ba.size, baseline_ms=med["wb"] * 1e3, measure_ms=med["wm"] * 1e3,
                        ratio=float(np.median(np.array(res["wm"]) / np.array(res["wb"]))),
                        cpu_ratio=float(np.median(np.array(res["cm"]) / np.array(res["cb"]))),
                        mtok_per_s=ba.size / med["wm"] / 1e6))
    return out


# -- pytest-benchmark ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def data():
    return make_data()


def test_baseline_abs_mean(benchmark, data):
    a, b = data[:2]
    benchmark(baseline, a, b)


@pytest.mark.parametrize("kernel", ["numpy", "numba"])
@pytest.mark.parametrize("layout", ["flat", "flat_long", "padded"])
def test_measure(benchmark, data, layout, kernel):
    if kernel == "numba":
        pytest.importorskip("numba")
    a, b, cu, pa, pb, pm, cu_long = data
    kw = {"_kernel": kernel}
    if layout == "flat":
        fn, ba, bb = (lambda: measure(a, b, cu_seqlens=cu, **kw)), a, b
    elif layout == "flat_long":
        fn, ba, bb = (lambda: measure(a, b, cu_seqlens=cu_long, **kw)), a, b
    else:
        fn, ba, bb = (lambda: measure(pa, pb, pm, **kw)), pa[pm], pb[pm]
    fn()                                  # warm up (numba: loads the kernels from its cache)
    t_base = _best(lambda: baseline(ba, bb))
    rep = benchmark(fn)
    t = benchmark.stats.stats.min
    benchmark.extra_info.update(tokens=rep.n_tokens, baseline_s=t_base, ratio_to_abs_mean=t / t_base,
                                mtok_per_s=rep.n_tokens / t / 1e6)
    assert rep.n_tokens == ba.size


if __name__ == "__main__":
    rounds = int(os.environ.get("SKYRL_BENCH_GAP_ROUNDS", 7))
    load0 = os.getloadavg()
    t0 = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    table = rows(rounds)
    load1 = os.getloadavg()
    print(f"gap.measure vs np.abs(a - b).mean(), {N:,} float32 tokens, medians of {rounds} interleaved rounds, "
          f"{os.cpu_count()} CPUs, {t0} UTC, load average {load0[0]:.2f} (start) / {load1[0]:.2f} (end)\n")
    print("| case | tokens | numpy abs-mean (ms) | measure (ms) | wall ratio | CPU-time ratio | Mtok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in table:
        print(f"| {r['case']} | {r['tokens']:,} | {r['baseline_ms']:.1f} | {r['measure_ms']:.1f} | "
              f"{r['ratio']:.2f} | {r['cpu_ratio']:.2f} | {r['mtok_per_s']:.0f} |")
