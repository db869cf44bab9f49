"""The layer-by-layer tracer (``skyrl-numerics trace``) at real layer dims (``real_dims.py``) and
its cost: a one-ulp change planted in layer 1's ``o_proj`` (its largest element) of the HF
trainer is named as ``L1.layer`` / ``L1.attn``; optionally the HF trainer against stock vLLM; and
the capture overhead — the tracer's own time (cutting rows, float32, hashing, stats) over the
forward's time, with and without ``--per-op``, measured in one process beside a plain forward.

One HF copy: the planted side is the same model traced again after the change (then put back).

    SKYRL_NUMERICS_CPU_MEMORY_SHARE=0.15 PYTHONPATH=src .venv/bin/python benchmarks/bench_trace.py \
        [--family qwen3_moe|deepseek_v3|tiny-qwen3_moe] [--engine] [--prompts 2] [--prompt-len 32]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def model_dir(family: str):
    if family.startswith("tiny-"):
        from skyrl_numerics.models import build_tiny_model

        return build_tiny_model(family[5:])
    from real_dims import build

    return build(family)


def plain_forward_s(model, seqs) -> float:
    import torch

    t0 = time.perf_counter()
    with torch.no_grad():
        for s in seqs:
            model(input_ids=torch.tensor([s]), use_cache=False)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="qwen3_moe")
    ap.add_argument("--engine", action="store_true", help="also HF vs stock vLLM (per-op)")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=32)
    a = ap.parse_args()

    from skyrl_numerics.doctor.trace import Side, compare, planted, trace_side
    from skyrl_numerics.models import load_hf_model
    from skyrl_numerics.rollout.prompts import make_prompts

    d = model_dir(a.family)
    hf = load_hf_model(d, dtype="bfloat16")
    seqs = make_prompts(a.prompts, a.prompt_len, hf.config.vocab_size, 0)
    out = {"family": a.family, "model_dir": str(d), "sequences": len(seqs),
           "tokens": sum(map(len, seqs))}
    plain_forward_s(hf, seqs[:1])                      # warm-up
    out["plain_forward_s"] = round(plain_forward_s(hf, seqs), 3)
    for per_op in (False, True):
        ref, _ = trace_side(Side("hf", "hf", hf), d, seqs, per_op=per_op)
        w = hf.model.layers[1].self_attn.o_proj.weight
        i, old = planted(w)
        try:
            moved, _ = trace_side(Side("hf", "hf, planted L1 o_proj", hf), d, seqs, per_op=per_op)
        finally:
            w.data.view(-1)[i] = old
        cmp = compare(ref, moved)
        f = cmp.first
        key = "per_op" if per_op else "per_layer"
        out[key] = {"first_divergence": None if f is None else f.name,
                    "rows_differing": None if f is None else f"{f.rows_differing}/{f.rows}",
                    "modules": len(ref.modules), "forward_s": round(ref.forward_s, 3),
                    "capture_s": round(ref.capture_s, 3),
                    "capture_over_forward": round(ref.capture_s / max(ref.forward_s
                                                                      - ref.capture_s, 1e-9), 4)}
        print(json.dumps({key: out[key]}), flush=True)
    if a.engine:
        from skyrl_numerics.engine.generator import VLLMGenerator

        # a small KV cache (the traced tokens only): vLLM CPU checks the free RAM against it
        gen = VLLMGenerator(d, kv_cache_memory_bytes=256 << 20, max_model_len=256)
        try:
            ref, _ = trace_side(Side("hf", "hf", hf), d, seqs, per_op=True)
            eng, _ = trace_side(Side("vllm", model=gen), d, seqs, per_op=True)
            cmp = compare(ref, eng)
            f = cmp.first
            out["hf_vs_vllm"] = {
                "first_divergence": None if f is None else f.name,
                "rows_differing": None if f is None else f"{f.rows_differing}/{f.rows}",
                "delta_max_abs": None if f is None else f.delta_max_abs,
                "layer_rows_differing": {m.name: f"{m.rows_differing}/{m.rows}"
                                         for m in cmp.modules if m.name.endswith("layer")},
                "engine_forward_s": round(eng.forward_s, 3),
                "engine_capture_s": round(eng.capture_s, 3),
                "vllm_schedule": {k: v for k, v in eng.info()["vllm_schedule"].items()
                                  if k != "steps"}}
        finally:
            gen.close()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
