"""gap.measure on 10M tokens vs one numpy pass ``np.abs(a - b).mean()`` over the same arrays.

Goal (issue 2): the full report <= 3x that single pass. Both are timed in the same process on
the same float32 arrays (best of several runs); the reported number is the ratio.

Layouts: flat + cu_seqlens with short (1..2000) and long (2K..16K, RL-reasoning-like) responses,
padded [B, 2000] with a right-padding mask, and the plain full-array reference path
(``measure_reference``) for scale. ``measure`` uses its default threads (up to 8, at most
``os.cpu_count()``); the ``threads=1`` row shows the single-core cost. ``numba:`` rows run the
optional compiled scan (bitwise-equal report; ``SKYRL_NUMERICS_NUMBA=1`` selects it in
``measure``); they appear when numba imports.

Tokens: ``SKYRL_BENCH_GAP_TOKENS`` (default 10_000_000). Run as a script for a markdown table
(``python benchmarks/bench_gap.py``) or under pytest-benchmark
(``pytest benchmarks/bench_gap.py --benchmark-only``).
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


def _has_numba() -> bool:
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def rows(repeat=5):
    a, b, cu, pa, pb, pm, cu_long = make_data()
    out = []
    cases = [
        ("flat + cu_seqlens, short seqs", lambda: measure(a, b, cu_seqlens=cu), a.size),
        ("flat + cu_seqlens, short seqs, threads=1", lambda: measure(a, b, cu_seqlens=cu, threads=1), a.size),
        ("flat + cu_seqlens, long seqs", lambda: measure(a, b, cu_seqlens=cu_long), a.size),
        ("padded [B, 2000] + mask", lambda: measure(pa, pb, pm), int(pm.sum())),
    ]
    if _has_numba():
        cases += [
            ("numba: flat + cu_seqlens, short seqs", lambda: measure(a, b, cu_seqlens=cu, _kernel="numba"), a.size),
            ("numba: flat + cu_seqlens, short seqs, threads=1",
             lambda: measure(a, b, cu_seqlens=cu, threads=1, _kernel="numba"), a.size),
            ("numba: flat + cu_seqlens, long seqs", lambda: measure(a, b, cu_seqlens=cu_long, _kernel="numba"), a.size),
            ("numba: padded [B, 2000] + mask", lambda: measure(pa, pb, pm, _kernel="numba"), int(pm.sum())),
        ]
    cases += [
        ("reference (full arrays)", lambda: measure_reference(a, b, cu_seqlens=cu), a.size),
    ]
    for name, fn, n_tok in cases:
        fn()  # warm up
        base_a, base_b = (a, b) if "padded" not in name else (pa[pm], pb[pm])
        rep = 2 if "reference" in name else repeat
        t_base = _best(lambda: baseline(base_a, base_b), repeat)
        t = _best(fn, rep)
        t_base = min(t_base, _best(lambda: baseline(base_a, base_b), repeat))   # interleave
        # CPU time of the whole process (all threads): robust to other load on the machine
        c_base = _best(lambda: baseline(base_a, base_b), repeat, time.process_time)
        c = _best(fn, rep, time.process_time)
        out.append(dict(case=name, tokens=n_tok, baseline_ms=t_base * 1e3, measure_ms=t * 1e3,
                        ratio=t / t_base, cpu_ratio=c / c_base, mtok_per_s=n_tok / t / 1e6))
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
    fn()                                  # warm up (numba: compiles once per process)
    t_base = _best(lambda: baseline(ba, bb))
    rep = benchmark(fn)
    t = benchmark.stats.stats.min
    benchmark.extra_info.update(tokens=rep.n_tokens, baseline_s=t_base, ratio_to_abs_mean=t / t_base,
                                mtok_per_s=rep.n_tokens / t / 1e6)
    assert rep.n_tokens == ba.size


if __name__ == "__main__":
    print(f"gap.measure vs np.abs(a - b).mean(), {N:,} float32 tokens, best of runs, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}\n")
    print("| case | tokens | numpy abs-mean (ms) | measure (ms) | wall ratio | CPU-time ratio | Mtok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows():
        print(f"| {r['case']} | {r['tokens']:,} | {r['baseline_ms']:.1f} | {r['measure_ms']:.1f} | "
              f"{r['ratio']:.2f} | {r['cpu_ratio']:.2f} | {r['mtok_per_s']:.0f} |")
