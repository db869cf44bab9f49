"""Where the invariant forward's time goes at real dims, per layer type (issue 26): the family's
blocks wrapped with timers (GEMMs of the attention projections, the routed experts — their
three grouped GEMMs, gather and combine —, the router, attention, norms, the LM head), run
in-process on the real-dims checkpoint (``real_dims.py``) for a prefill of P prompts x L
tokens and for decode-shaped calls (P rows, one token per prompt: the GEMM and expert shapes
of a decode step; the attention there reads one key, so it understates a real decode's).

    .venv/bin/python benchmarks/profile_real_dims.py [--family qwen3_moe|deepseek_v3|qwen3_next]
        [--prompts 4] [--prompt-len 32] [--repeats 3]
        [--config '{"num_experts": 128}']   # overrides of the real-dims config (a small host)

Qwen3-Next's Gated DeltaNet is split into its fp32 token-by-token scan (``delta_scan``), the
causal conv and the q/k l2norm (the projections count as projections).

Prints JSON: per phase, ms per call of the forward and each block type's share; and the
physical bound of a decode step on this machine: the bytes of the weights it reads (LM head,
attention and dense weights, the distinct experts the step's tokens route to) over the
measured single-thread copy bandwidth (``dst.copy_(src)`` of 512 MiB: read + write bytes).
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="qwen3_moe")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--config", default="{}", help="JSON object of overrides of the real-dims config")
    args = ap.parse_args()

    import torch

    from real_dims import build
    from skyrl_numerics.invariant import base, from_checkpoint

    model = from_checkpoint(build(args.family, **json.loads(args.config)))
    fam = __import__(type(model).__module__, fromlist=["x"])
    spent: dict[str, float] = defaultdict(float)

    def timed(name, fn):
        def run(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.perf_counter() - t0
        return run

    names = {"linear": "projections (linear)", "linear_many": "projections (linear)",
             "head_matmuls": "MLA absorbed products", "routed_experts": "routed experts",
             "swiglu_mlp": "dense / shared MLP", "softmax_topk": "router top-k",
             "sigmoid_group_topk": "router top-k", "rms_norm": "norms", "rms_norm_heads": "norms",
             "qk_norm_rope_rows": "q/k norm + rope", "delta_scan": "Gated DeltaNet scan",
             "causal_conv": "GDN causal conv", "l2norm": "GDN q/k l2norm"}
    for mod in (fam, base):
        for n, label in names.items():
            if hasattr(mod, n):
                setattr(mod, n, timed(label, getattr(mod, n)))
    model.attention_op = timed("attention", model.attention_op)
    lm = model.logits
    model.logits = timed("LM head", lm)

    g = torch.Generator().manual_seed(0)
    vocab = int(model.w("lm_head.weight").shape[0])
    out = {}
    for phase, n in (("prefill", args.prompt_len), ("decode-shaped", 1)):
        seqs = [torch.randint(2, vocab, (n,), generator=g) for _ in range(args.prompts)]
        with torch.no_grad():
            h = model.packed_hidden(seqs)
            model.logits(h[-args.prompts:])
            spent.clear()
            t0 = time.perf_counter()
            for _ in range(args.repeats):
                h = model.packed_hidden(seqs)
                model.logits(h if phase != "prefill" else h[-args.prompts:])
            total = (time.perf_counter() - t0) / args.repeats
        per = {k: round(v / args.repeats * 1e3, 2) for k, v in sorted(spent.items(), key=lambda x: -x[1])}
        inner = sum(per.values())
        out[phase] = {"tokens": n * args.prompts, "ms_per_forward": round(total * 1e3, 1),
                      "ms_by_block": per, "other_ms": round(total * 1e3 - inner, 1)}
    out["decode_bound"] = _decode_bound(model, args.prompts, vocab, g)
    print(json.dumps(out, indent=2))


def _decode_bound(model, prompts: int, vocab: int, g) -> dict:
    import torch

    torch.set_num_threads(1)        # as the engine's worker runs (vLLM CPU: one thread here)
    src = torch.ones(256 << 20, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    bw = 2 * src.numel() * 2 / best                     # bytes read + written per second
    ids: dict[int, set] = {}
    model.route_hook = lambda layer, e: ids.setdefault(layer, set()).update(e.reshape(-1).tolist())
    with torch.no_grad():
        model.packed_hidden([torch.randint(2, vocab, (1,), generator=g) for _ in range(prompts)])
    model.route_hook = None
    expert_bytes = active = 0
    moe_layers = sorted({_layer_expert(n)[0] for n in model.hf_names() if ".experts." in n})
    for name in model.hf_names():
        t = model.w(name)
        nbytes = t.numel() * t.element_size()
        if ".experts." in name:
            layer, e = _layer_expert(name)
            if e in ids.get(moe_layers.index(layer), ()):
                active += nbytes
            expert_bytes += nbytes
        elif "embed_tokens" not in name:
            active += nbytes
    return {"copy_gb_per_s": round(bw / 1e9, 2), "active_weight_bytes_per_step": active,
            "distinct_experts_per_layer": {k: len(v) for k, v in ids.items()},
            "bound_ms_per_step": round(active / bw * 1e3, 1),
            "bound_tokens_per_s": round(prompts * bw / active, 2)}


def _layer_expert(name: str):
    """(layer, expert) of ``model.layers.L.mlp.experts.E.*``."""
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1]), int(parts[parts.index("experts") + 1])


if __name__ == "__main__":
    main()
