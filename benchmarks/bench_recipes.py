"""The seed recipes' serving numerics in the invariant forward: memory, time, adapter sync bytes.

Every number is a ratio against a baseline measured in the same process:

1. **Packed weights** (``invariant/numerics.py``): the invariant model with the ``ml4``
   plan (NVFP4 W4A4 routed experts, FP8 W8A8 attention — codes + scales kept packed, decoded per
   call, activations quantized per token) and with the ``k2`` plan (INT4 W4A16 experts), against
   the same model in bf16: bytes held by the model (parameters + packed codes/scales) and the
   wall time of one no-grad forward over ``S`` sequences of ``L`` tokens (``sequence_hidden`` +
   lm-head), best of ``reps``.
2. **Adapter-only sync** (LoRA rank 32 on attention, dense, shared and routed experts, per-expert
   adapters): the raw bytes one step sends against a full bf16 sync of the model, from the
   model's own tensor shapes (meta device) — at the real per-layer dims of ``real_dims.py`` and
   per layer, so the ratio holds for any depth.

Script: ``python benchmarks/bench_recipes.py [--family qwen3_moe] [--dims tiny|real] [--out DIR]``
(markdown table, JSON, PNG); pytest-benchmark: ``pytest benchmarks/bench_recipes.py
--benchmark-only`` (the tiny model).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from _timing import best


def _plans(family: str, model_dir):
    from skyrl_numerics.trainer.seed_recipes import get_recipe, resolve

    kv = [] if family == "deepseek_v3" else ["kv_cache=auto"]
    nolora = ["lora_rank=0"]
    return {"bf16": None,
            "ml4 (W4A4 experts, W8A8 attn)": resolve(get_recipe("ml4", kv + nolora), model_dir)[0],
            "k2 (W4A16 experts)": resolve(get_recipe("k2", nolora), model_dir)[0]}


def model_bytes(model) -> int:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    for q in model._packed.values():
        n += sum(t.numel() * t.element_size() for t in (q.codes, q.scales) if t is not None)
        n += 0 if q.global_scale is None else q.global_scale.numel() * 4
    return n


def forward_cost(model_dir, family: str, seqs: int = 4, length: int = 64, reps: int = 2) -> dict:
    import torch
    from transformers import AutoConfig

    from skyrl_numerics.invariant import family_class
    from skyrl_numerics.invariant.base import iter_checkpoint_tensors

    cfg = AutoConfig.from_pretrained(str(model_dir))
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, cfg.vocab_size, (length,), generator=g) for _ in range(seqs)]
    out = {}
    for name, plan in _plans(family, model_dir).items():
        cls = family_class(cfg.architectures[0])
        m = cls.from_config(cfg, numerics=plan, pack=True)   # the engine's side: packed
        m.load_named(iter_checkpoint_tensors(model_dir, names=m._names))

        def fwd():
            with torch.no_grad():
                m.logits(m.packed_hidden(ids))
        out[name] = {"bytes": model_bytes(m), "s": best(fwd, reps)}
        del m
    base = out["bf16"]
    for v in out.values():
        v["bytes_ratio"], v["time_ratio"] = v["bytes"] / base["bytes"], v["s"] / base["s"]
    return {"tokens": seqs * length, **out}


def adapter_bytes(family: str, cfg_overrides: dict) -> dict:
    from skyrl_numerics.models import tiny_config
    from skyrl_numerics.invariant.numerics import NumericsPlan, plan_adapter_shapes

    cfg = tiny_config(family, **cfg_overrides)
    import math
    from types import SimpleNamespace

    import torch

    from skyrl_numerics.invariant import family_class

    cls = family_class(cfg["architectures"][0])
    with torch.device("meta"):
        m = cls(**cls.config_parts(SimpleNamespace(**cfg)))
    full = sum(2 * math.prod(m.w(n).shape) for n in m.hf_names())
    layer = [n for n in m.hf_names() if n.startswith("model.layers.1.")]
    full_layer = sum(2 * math.prod(m.w(n).shape) for n in layer)
    out = {"full_bytes": full}
    for rank in (8, 32):
        plan = NumericsPlan(lora_rank=rank, lora_alpha=2 * rank,
                            lora_targets=("attention", "dense", "shared", "experts"))
        shapes = plan_adapter_shapes(plan, cfg)
        ad = sum(2 * math.prod(s) for s in shapes.values())
        ad_layer = sum(2 * math.prod(s) for n, s in shapes.items() if n.startswith("model.layers.1."))
        out[f"rank{rank}"] = {"adapter_bytes": ad, "ratio": ad / full,
                              "moe_layer_ratio": ad_layer / full_layer}
    return out


# ---- pytest-benchmark -----------------------------------------------------------------------
def test_packed_w4a4_forward_tiny(benchmark):
    import torch

    from skyrl_numerics.models import build_tiny_model
    from skyrl_numerics.invariant import from_checkpoint

    d = build_tiny_model("qwen3_moe")
    plan = _plans("qwen3_moe", d)["ml4 (W4A4 experts, W8A8 attn)"]
    m = from_checkpoint(d, numerics=plan)
    ids = torch.arange(64) % 512
    with torch.no_grad():
        benchmark(lambda: m.sequence_hidden(ids))


def _plot(path: Path, res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f = res["forward"]
    names = [k for k in f if isinstance(f[k], dict)]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    ax[0].bar(names, [f[k]["bytes_ratio"] for k in names])
    ax[0].set_title("model bytes vs bf16 (packed codes + scales)")
    ax[1].bar(names, [f[k]["time_ratio"] for k in names])
    ax[1].set_title(f"no-grad forward time vs bf16 ({f['tokens']} tokens)")
    for a in ax:
        a.tick_params(axis="x", labelsize=8)
    fig.tight_layout(); fig.savefig(path, dpi=110); plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="qwen3_moe", choices=["qwen3_moe", "deepseek_v3"])
    ap.add_argument("--dims", default="tiny", choices=["tiny", "real"])
    ap.add_argument("--out", default="artifacts/bench_recipes")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from real_dims import CONFIGS, build

    from skyrl_numerics.models import build_tiny_model

    d = build(a.family) if a.dims == "real" else build_tiny_model(a.family)
    res = {"family": a.family, "dims": a.dims, "forward": forward_cost(d, a.family),
           "adapters_real_dims": adapter_bytes(a.family, CONFIGS[a.family])}
    f = res["forward"]
    print(f"| {a.family} ({a.dims} dims), {f['tokens']} tokens | model bytes | vs bf16 | forward s | vs bf16 |")
    print("|---|---|---|---|---|")
    for k, v in f.items():
        if isinstance(v, dict):
            print(f"| {k} | {v['bytes'] / 1e6:,.1f} MB | {v['bytes_ratio']:.3f} | {v['s']:.3f} | {v['time_ratio']:.2f} |")
    ad = res["adapters_real_dims"]
    print(f"\n| LoRA adapters, {a.family} real per-layer dims | bytes / step | vs full bf16 sync | per MoE layer |")
    print("|---|---|---|---|")
    for r in ("rank8", "rank32"):
        print(f"| {r} | {ad[r]['adapter_bytes'] / 1e6:,.1f} MB | {ad[r]['ratio']:.4f} | {ad[r]['moe_layer_ratio']:.4f} |")
    (out / "bench_recipes.json").write_text(json.dumps(res, indent=1))
    _plot(out / "bench_recipes.png", res)
    print(f"wrote {out / 'bench_recipes.json'}, {out / 'bench_recipes.png'}")


if __name__ == "__main__":
    main()
