"""What each of the doctor's trainer copies really takes, against what the memory plan counts
(:func:`skyrl_numerics.doctor.trainer_memory.trainer_copy_bytes`): one fresh process per copy loads it
as the doctor does (``DoctorContext``) and scores one synthetic rollout of ``--prompts`` ×
(``--prompt-len`` + ``--max-tokens``) tokens with the row's own trainer; the process's RSS is
sampled every 20 ms (psutil) before, during and after.

    .venv/bin/python benchmarks/doctor_copy_memory.py [--family qwen3_moe] [--json FILE]

Prints one line per copy: planned bytes (parameters + buffers, by dtype; + the scoring work),
RSS held once loaded, peak RSS while loading and while scoring (each above the process's RSS
before the load).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

GiB = 1 << 30
ROWS = {   # one row per trainer copy of the default table (the row's own trainer)
    "HF bfloat16": "baseline: HF trainer, bf16",
    "HF float32": "HF trainer, fp32 weights",
    "invariant": "+ batch-invariant (trainer and vLLM)",
    "invariant (KV fp8)": "+ batch-invariant, FP8 KV (trainer simulates the cache)",
    "HF bfloat16 + QAT nvfp4": "nvfp4 experts: + fake-quant matched",
}


def child(model_dir: str, row_name: str, n: int, plen: int, new: int) -> dict:
    import threading
    import time

    import numpy as np
    import psutil

    from skyrl_numerics.doctor import trainer_memory as tm
    from skyrl_numerics.doctor import ROWS as TABLE, DoctorContext
    from skyrl_numerics.doctor.model_check import inspect_checkpoint
    from skyrl_numerics.rollout import Rollout

    info = inspect_checkpoint(model_dir)
    ctx = DoctorContext(model_dir=Path(model_dir), family=info.model_type, info=info)
    row = next(r for r in TABLE if r.name == row_name)
    key = tm.trainer_key(row, ctx.dtype)
    planned = tm.trainer_copy_bytes(info, key)
    work = tm.scoring_bytes(info, key, n_prompts=n, seq_len=plen + new)
    rng = np.random.default_rng(0)
    ro = Rollout.from_lists([rng.integers(2, 1000, plen).tolist() for _ in range(n)],
                            [rng.integers(2, 1000, new).tolist() for _ in range(n)],
                            [[-6.0] * new for _ in range(n)], sampling={"temperature": 1.0},
                            engine="none", engine_version="0")
    proc, peak, stop = psutil.Process(), [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.02)

    th = threading.Thread(target=sample, daemon=True)
    base = proc.memory_info().rss
    peak[0] = base
    th.start()
    t0 = time.time()
    if key[0] == "invariant":
        from skyrl_numerics.invariant import from_checkpoint

        ctx._models[key] = from_checkpoint(ctx.model_dir, kv_cache=key[1])
    else:
        ctx.hf_model(*key)
    t_load = time.time() - t0
    held, load_peak = proc.memory_info().rss, peak[0]
    peak[0] = held
    t0 = time.time()
    row.compute(ctx, ro)
    t_score = time.time() - t0
    score_peak = peak[0]
    stop.set()
    th.join()
    return {"copy": tm.copy_name(key), "row": row_name, "planned_bytes": planned,
            "planned_total": sum(planned.values()), "planned_work": work,
            "held": held - base, "load_peak": load_peak - base, "score_peak": score_peak - base,
            "load_s": round(t_load, 1), "score_s": round(t_score, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="qwen3_moe")
    ap.add_argument("--model", help="checkpoint dir (default: benchmarks/real_dims.py's)")
    ap.add_argument("--copies", default=",".join(ROWS))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(a.model, a.child, a.prompts, a.prompt_len,
                                           a.max_tokens)))
        return
    if a.model is None:
        sys.path.insert(0, str(Path(__file__).parent))
        import real_dims

        a.model = str(real_dims.build(a.family))
    out = []
    for name in a.copies.split(","):
        p = subprocess.run([sys.executable, __file__, "--model", a.model, "--child", ROWS[name],
                            "--prompts", str(a.prompts), "--prompt-len", str(a.prompt_len),
                            "--max-tokens", str(a.max_tokens)], capture_output=True, text=True)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(f"{name}: failed (rc {p.returncode}): {p.stderr[-600:]}")
            continue
        r = json.loads(line[7:])
        out.append(r)
        print(f"{r['copy']:28s} planned {r['planned_total'] / GiB:5.2f} GiB "
              f"({', '.join(f'{k} {v / GiB:.2f}' for k, v in r['planned_bytes'].items())}) "
              f"+ work {r['planned_work'] / GiB:4.2f} | held {r['held'] / GiB:5.2f}  "
              f"load peak {r['load_peak'] / GiB:5.2f}  score peak {r['score_peak'] / GiB:5.2f} GiB"
              f"  (load {r['load_s']} s, score {r['score_s']} s)", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"model": a.model, "copies": out}, indent=1))


if __name__ == "__main__":
    main()
