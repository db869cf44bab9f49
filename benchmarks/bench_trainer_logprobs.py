"""Trainer logprobs at a real vocabulary (issue 26 item 4): the invariant trainer's response
logprobs on the real-dims Qwen3-MoE checkpoint (vocab 151,936; ``real_dims.py``), time and peak
memory per 1k response tokens, with the LM head + log-softmax in chunks of response rows (the
default, ``base.LOGIT_CHUNK_BYTES`` = 64 MiB of logits) vs one chunk per sequence (the previous
behaviour) — the same bits, checked — and vs the HF trainer (``trainer_logprobs``, transformers'
forward, 1024-token chunks) on the same rollout. Each variant runs in its own child process, so
its peak RSS (VmHWM) is its own; the checkpoint's bf16 weights (2.4 GiB) are in every figure.

    .venv/bin/python -m pytest benchmarks/bench_trainer_logprobs.py --benchmark-only -q -s
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = r"""
import json, sys, time
import numpy as np
from real_dims import build          # (the child runs in benchmarks/: -c puts the cwd on the path)
from skyrl_numerics.rollout import Rollout
variant, n_seq, p_len, r_len = sys.argv[1], *map(int, sys.argv[2:5])
d = build("qwen3_moe")
rng = np.random.default_rng(0)
ro = Rollout.from_lists([rng.integers(2, 151936, p_len).tolist() for _ in range(n_seq)],
                        [rng.integers(2, 151936, r_len).tolist() for _ in range(n_seq)],
                        [[-1.0] * r_len for _ in range(n_seq)])
if variant == "hf":
    from skyrl_numerics.models import load_hf_model
    from skyrl_numerics.trainer import trainer_logprobs
    m = load_hf_model(d)
    run = lambda: trainer_logprobs(m, ro, batch_size=4)
else:
    from skyrl_numerics.invariant import base, from_checkpoint
    from skyrl_numerics.trainer.logprobs import invariant_trainer_logprobs
    if variant == "whole":
        base.LOGIT_CHUNK_BYTES = 1 << 62
    m = from_checkpoint(d)
    run = lambda: invariant_trainer_logprobs(m, ro, batch_size=4)
t0 = time.perf_counter(); out = run(); dt = time.perf_counter() - t0
hwm = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")][0] / 2**20
print(json.dumps({"s": dt, "peak_rss_gib": hwm, "lp": out.logprobs.view(np.uint32).tolist()}))
"""


def _run(variant: str, n_seq=4, p_len=32, r_len=256) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, variant, str(n_seq), str(p_len), str(r_len)],
                       capture_output=True, text=True, timeout=1800, cwd=Path(__file__).parent)
    if r.returncode != 0:
        raise RuntimeError(f"{variant}: {r.stderr.strip().splitlines()[-1:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("r_len", [256])
def test_trainer_logprobs_real_vocab(benchmark, r_len):
    res = {}
    benchmark.pedantic(lambda: res.update(chunked=_run("chunked", r_len=r_len)), rounds=1, iterations=1)
    res["whole"] = _run("whole", r_len=r_len)
    res["hf"] = _run("hf", r_len=r_len)
    assert res["chunked"]["lp"] == res["whole"]["lp"]          # chunking changes no bit
    k = 4 * r_len / 1000
    for name, v in res.items():
        print(f"\n{name}: {v['s'] / k:.2f} s and peak RSS {v['peak_rss_gib']:.2f} GiB per 1k response "
              f"tokens ({4 * r_len} tokens, {v['s']:.1f} s)")
    benchmark.extra_info.update({f"{n}_s_per_1k": round(v["s"] / k, 3) for n, v in res.items()})
    benchmark.extra_info.update({f"{n}_peak_rss_gib": round(v["peak_rss_gib"], 3) for n, v in res.items()})
