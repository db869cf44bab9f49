"""Router replay with the engine's gate (combine) weights vs ids-only R3 (issue 39, item 3).

For each checkpoint: one stock vLLM CPU engine with route capture samples the doctor's "full"
scenario (temperature 1, full vocabulary) with ``gate_weights="float32"``; the HF trainer (bf16, as
the doctor's stock rows) recomputes the response logprobs with

* no replay (the doctor's baseline row),
* ids-only R3 (``route_replay``, the trainer's own gate values at the engine's experts),
* ids + the engine's weights stored as fp16 / bf16 / fp32 (``route_replay(weights="engine")``),

and the script prints mean / max |Δ| against the engine's logprobs, the share of tokens whose
|Δ| shrank, and the bytes per token of ids and weights (``L * k * itemsize``).

    PYTHONPATH=src .venv/bin/python benchmarks/bench_gate_replay.py [tiny_qwen3_moe tiny_deepseek_v3 real_qwen3_moe] \
        [--prompts 8] [--prompt-len 32] [--max-tokens 48]

``real_qwen3_moe`` is benchmarks/real_dims.py's Qwen3-MoE-30B-A3B layer pair (2 layers, 64 experts
top-8, vocab 151,936; 2.5 GB in bf16).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np


def checkpoint(name: str) -> Path:
    from skyrl_numerics.models import build_tiny_model

    kind, family = name.split("_", 1)
    if kind == "tiny":
        return build_tiny_model(family)
    sys.path.insert(0, str(Path(__file__).parent))
    from real_dims import build

    return build(family)


def regated(ro, dtype: str):
    """``ro`` with its float32 gates stored as ``dtype``."""
    from skyrl_numerics.replay import PackedGates
    from skyrl_numerics.replay.gates import encode_gates

    g = PackedGates(encode_gates(ro.gates.to_float32(), dtype), ro.gates.cu_seqlens, dtype)
    return dataclasses.replace(ro, gates=g)


def measure(name: str, args) -> dict:
    from skyrl_numerics.models import load_hf_model
    from skyrl_numerics.trainer import get_generator
    from skyrl_numerics.trainer.logprobs import trainer_logprobs

    d = checkpoint(name)
    gen = get_generator(d, capture_routes=True, max_model_len=args.prompt_len + args.max_tokens + 8)
    rng = np.random.default_rng(args.seed)
    prompts = [[int(x) for x in rng.integers(2, min(gen.vocab_size, 30000), size=args.prompt_len)]
               for _ in range(args.prompts)]
    ro = gen.generate(prompts, max_tokens=args.max_tokens, seed=args.seed, gate_weights="float32")
    gen.close()
    model = load_hf_model(d)
    ref = ro.rollout_logprobs
    rows = {}
    base_ids = None
    for label, rollout, kw in (
            ("HF trainer, no replay", ro, {}),
            ("+ R3 (ids only)", ro, dict(use_routes=True)),
            ("+ R3 with gate weights (fp16)", regated(ro, "float16"), dict(use_routes=True, use_gates=True)),
            ("+ R3 with gate weights (bf16)", regated(ro, "bfloat16"), dict(use_routes=True, use_gates=True)),
            ("+ R3 with gate weights (fp32)", ro, dict(use_routes=True, use_gates=True))):
        dlt = np.abs(trainer_logprobs(model, rollout, batch_size=2, **kw).logprobs - ref)
        if label == "+ R3 (ids only)":
            base_ids = dlt
        rows[label] = dict(mean=float(dlt.mean()), max=float(dlt.max()),
                           shrank=None if base_ids is None or label.endswith("only)") else
                           float((dlt < base_ids).mean()))
    L, k = ro.routes.num_layers, ro.routes.k
    eng = ro.gates.to_float32()
    return dict(checkpoint=name, path=str(d), tokens=int(ro.num_response_tokens), layers=L, k=k,
                experts=ro.routes.num_experts, rows=rows,
                bytes_per_token=dict(ids=L * k * ro.routes.values.itemsize, fp16=L * k * 2,
                                     bf16=L * k * 2, fp32=L * k * 4),
                storage_max_rel_err={dt: float(np.max(np.abs(regated(ro, dt).gates.to_float32() - eng)
                                                      / np.abs(eng))) for dt in ("float16", "bfloat16")})


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoints", nargs="*", default=["tiny_qwen3_moe", "tiny_deepseek_v3"])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for name in args.checkpoints:
        res = measure(name, args)
        print(json.dumps(res))
        print(f"\n{name}: {res['tokens']} response tokens, L={res['layers']} k={res['k']} "
              f"E={res['experts']}; bytes/token ids {res['bytes_per_token']['ids']}, weights fp16 "
              f"{res['bytes_per_token']['fp16']} (fp32 {res['bytes_per_token']['fp32']})")
        print("| row | mean |Δ| | max |Δ| | tokens closer than ids-only |\n|---|---|---|---|")
        for label, r in res["rows"].items():
            sh = "" if r["shrank"] is None else f"{100 * r['shrank']:.0f}%"
            print(f"| {label} | {r['mean']:.3e} | {r['max']:.3e} | {sh} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
