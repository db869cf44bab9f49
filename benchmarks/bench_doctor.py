"""Wall time of the full default ``skyrl-numerics doctor`` table (what ``make demo`` runs), and
the share of it spent starting engines.

Issue 14's aim: the default table in <= 3 minutes on 2 CPU cores. One run, the tiny Qwen3-MoE,
8 prompts x 64 tokens, every default row (engines: stock with route capture, batch-invariant,
batch-invariant FP8 KV, a real INT4 engine; the fake-quant scenarios reuse the stock engine by
loading their weights in place). Run as a script (``python benchmarks/bench_doctor.py``) or
under pytest-benchmark (``pytest benchmarks/bench_doctor.py --benchmark-only``, one round).
"""
from __future__ import annotations

import json
import os
import time


def run_once() -> dict:
    import tempfile

    from skyrl_numerics.doctor import run_doctor
    from skyrl_numerics.engine import generator

    starts = []
    real_init = generator.VLLMGenerator.__init__

    def timed_init(self, *a, **kw):
        t = time.perf_counter()
        real_init(self, *a, **kw)
        starts.append(time.perf_counter() - t)
    generator.VLLMGenerator.__init__ = timed_init
    try:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory():
            res = run_doctor(progress=False)
        wall = time.perf_counter() - t0
    finally:
        generator.VLLMGenerator.__init__ = real_init
        for g in list(generator._CACHE.values()):
            g.close()
        generator._CACHE.clear()
    measured = sum(1 for r in res.rows if r.extra.get("status") == "measured")
    return {"wall_s": round(wall, 1), "engine_starts": len(starts),
            "engine_start_s": round(sum(starts), 1), "rows": len(res.rows), "rows_measured": measured,
            "load_avg": os.getloadavg()}


def test_doctor_default_table(benchmark):
    out = benchmark.pedantic(run_once, rounds=1, iterations=1)
    benchmark.extra_info.update(out)
    print("\n" + json.dumps(out))


if __name__ == "__main__":
    print(json.dumps(run_once(), indent=1))
