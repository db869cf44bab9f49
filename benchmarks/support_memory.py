"""Memory per token of the captured top-p support: CSR (PackedSupport) vs a dense vocabulary mask.

Runs the real vLLM CPU engine with the sampler-side capture (top-p alone, and top-p + top-k) on the
tiny Qwen3-MoE at two vocabulary sizes (512, and Qwen's 151,936), and prints a markdown table:
mean / max support size, CSR bytes per token (4 B per id + 8 B offset), dense bool mask (V B) and
bit-packed mask (V/8 B) per token.

    python benchmarks/support_memory.py [--tokens 32] [--prompts 4]

vLLM's output goes to a temporary log (engine/quiet.py).
"""
from __future__ import annotations

import argparse
import os


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=4)
    args = ap.parse_args()
    os.environ.setdefault("SKYRL_NUMERICS_CACHE_DIR",
                          os.path.join(os.path.dirname(__file__), "..", ".cache"))
    from skyrl_numerics.models import build_tiny_model
    from skyrl_numerics.engine.generator import VLLMGenerator
    from skyrl_numerics.engine.quiet import EngineLog

    rows = []
    settings = [("top_p 0.95", dict(top_p=0.95, top_k=0)), ("top_p 0.5", dict(top_p=0.5, top_k=0)),
                ("top_p 0.95, temperature 0.5", dict(top_p=0.95, top_k=0, temperature=0.5)),
                ("top_p 0.9 + top_k 1000", dict(top_p=0.9, top_k=1000))]
    for vocab in (512, 151936):
        d = build_tiny_model("qwen3_moe", vocab_size=vocab)
        with EngineLog():
            gen = VLLMGenerator(d)
            prompts = [[(7 * i + 3 * j) % (vocab - 2) + 2 for j in range(16)]
                       for i in range(args.prompts)]
            for name, kw in settings:
                kw = {"temperature": 1.0, **kw}
                ro = gen.generate(prompts, max_tokens=args.tokens, seed=0, capture_support=True,
                                  **kw)
                s = ro.support
                n = s.num_tokens
                rows.append((vocab, name, n, s.sizes.mean(), int(s.sizes.max()), s.nbytes / n,
                             s.dense_mask_nbytes() / n, s.dense_mask_nbytes(bits=True) / n))
            gen.close()
    print("| vocab | sampling | tokens | mean support | max support | CSR B/token | "
          "bool mask B/token | bit mask B/token | CSR / bool |")
    print("|---|---|---|---|---|---|---|---|---|")
    for v, name, n, mean, mx, csr, dense, bits in rows:
        print(f"| {v:,} | {name} | {n} | {mean:.1f} | {mx} | {csr:,.0f} | {dense:,.0f} | "
              f"{bits:,.0f} | {csr / dense:.2f} |")


if __name__ == "__main__":
    main()
