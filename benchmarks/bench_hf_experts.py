"""The published trainer's fused-experts forward (``quant/hf_experts.py``): what quantizing both expert
GEMM inputs and per-expert LoRA cost against transformers' own experts forward.

One Qwen3-MoE-30B-A3B experts module (64 experts of width 768, hidden 2048, top-8: the layer of
``real_dims.py``), float32 as the published trainer holds it, ``T`` tokens routed at random.
Forward + backward (sum of squares) wall time, best of ``reps``, as a ratio against the baseline
run in the same process — transformers' default experts implementation (``grouped_mm``):

- ``eager``: transformers' per-expert loop (what ``hf_experts.experts_forward`` reproduces bitwise
  with nothing installed);
- ``W4A4 act only``: the loop with NVFP4 on both GEMM inputs (``apply_qat`` act rule);
- ``W4A4``: NVFP4 weights (fake-quant, STE, read once per call) + NVFP4 activations;
- ``W4A4 + LoRA r32``: the same + per-expert adapters on gate / up / down (base frozen, so its
  weights are fake-quantized once: ``quant.qat.bake_frozen``, as the FSDP trainer does).

Peak memory is not measured here: the loop keeps one expert's rows at a time, the fake-quantized
weights are one extra copy of the module's weights per call (as every QAT parametrization).

Script: ``python benchmarks/bench_hf_experts.py [--tokens 256] [--out DIR]`` (markdown table,
JSON, PNG); pytest-benchmark: ``pytest benchmarks/bench_hf_experts.py --benchmark-only`` (small).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from _timing import best

H, I, E, K = 2048, 768, 64, 8


def _module(impl: str, E=E, H=H, I=I):
    import torch
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E)
    cfg._experts_implementation = impl
    torch.manual_seed(0)
    m = Qwen3MoeExperts(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.02)
    return m


def _variant(name: str, E=E, H=H, I=I):
    import torch
    from torch import nn

    from skyrl_numerics.quant import QATRule, apply_qat
    from skyrl_numerics.trainer.fsdp.lora import apply_lora

    if name == "grouped_mm (baseline)":
        return _module("grouped_mm", E, H, I)
    m = _module("eager", E, H, I)
    if name == "eager":
        return m
    act = {"convention": "vllm", "global_amax": torch.tensor(2688.0)}
    rule = QATRule("experts", "nvfp4" if name != "W4A4 act only" else None,
                   {"convention": "vllm"} if name != "W4A4 act only" else {},
                   act_recipe="nvfp4", act_opts=act)
    wrap = nn.ModuleDict({"experts": m})
    apply_qat(wrap, [rule])
    if name.endswith("LoRA r32"):      # as the FSDP trainer does: LoRA, then the frozen base baked
        from skyrl_numerics.quant.qat import bake_frozen

        apply_lora(wrap, rank=32, alpha=64.0, patterns=("experts",))
        bake_frozen(wrap)
    return m


VARIANTS = ("grouped_mm (baseline)", "eager", "W4A4 act only", "W4A4", "W4A4 + LoRA r32")


def run(tokens: int = 256, reps: int = 2, E=E, H=H, I=I) -> dict:
    import torch

    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    w = torch.rand(tokens, K, generator=g)
    out = {}
    for name in VARIANTS:
        m = _variant(name, E, H, I)
        xi = x.clone().requires_grad_(True)

        def step():
            m.zero_grad(set_to_none=True)
            m(xi, idx, w).square().sum().backward()
        out[name] = {"s": best(step, reps)}
        del m
    base = out[VARIANTS[0]]["s"]
    for v in out.values():
        v["ratio"] = v["s"] / base
    return {"tokens": tokens, "dims": {"E": E, "H": H, "I": I, "top_k": K}, "variants": out}


# ---- pytest-benchmark -----------------------------------------------------------------------
def test_w4a4_lora_experts_small(benchmark):
    import torch

    m = _variant("W4A4 + LoRA r32", E=8, H=256, I=128)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=g, requires_grad=True)
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(64)])
    w = torch.rand(64, 2, generator=g)
    benchmark(lambda: m(x, idx, w).square().sum().backward())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default="artifacts/bench_hf_experts")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res = run(a.tokens, a.reps)
    print(f"| Qwen3-MoE-30B-A3B experts (E {E}, H {H}, I {I}, top-{K}), {a.tokens} tokens, fp32, "
          "forward + backward | s | vs grouped_mm |")
    print("|---|---|---|")
    for k, v in res["variants"].items():
        print(f"| {k} | {v['s']:.3f} | {v['ratio']:.2f} |")
    (out / "bench_hf_experts.json").write_text(json.dumps(res, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    names = list(res["variants"])
    ax.bar(names, [res["variants"][k]["ratio"] for k in names])
    ax.set_ylabel("time vs grouped_mm")
    ax.set_title(f"experts forward + backward, {a.tokens} tokens (fp32)")
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout(); fig.savefig(out / "bench_hf_experts.png", dpi=110); plt.close(fig)
    print(f"wrote {out / 'bench_hf_experts.json'}, {out / 'bench_hf_experts.png'}")


if __name__ == "__main__":
    main()
