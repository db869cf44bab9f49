"""vLLM CPU throughput: a family's batch-invariant out-of-tree model vs vLLM's own model.

Both engines serve the same tiny checkpoint in the same process run and are alive together;
after a warm-up the rounds alternate between them (stock, invariant, stock, ...), each round
generating the same prompts, with a pause between turns so the idle engine's worker stops
busy-waiting (vLLM spins for 1 s after its last step). The best tokens/s per engine is kept and
so is the ratio of each round's pair: on a shared machine whose speed drifts, interleaving keeps
both engines under the same conditions. Reported: the ratio invariant / stock (the cost of
bitwise alignment; best-of and the median of the per-round ratios), and the fraction of tokens
whose logprobs equal the trainer's bitwise for each engine.

    .venv/bin/python benchmarks/bench_vllm_invariant.py [--family qwen3_moe|deepseek_v3]
        [--kv-cache auto,fp8[,fp8_ds_mla]] [--prompts 16] [--max-tokens 64]
        [--config '{"hidden_size": 1024, ...}']   # overrides of the tiny config (a larger model)
        [--forward-times] [--engine-args '{"kv_cache_memory_bytes": 1073741824}']
        [--peak-rss]   # each engine's peak RSS (its worker process), from /proc
        [--real-dims]  # the real-dims checkpoint of benchmarks/real_dims.py (issue 26);
                       # --config then overrides its entries (e.g. fewer experts)
        [--sequential] # one engine alive at a time (a shared host): each engine's rounds run
                       # back to back, then it closes before the next starts

``--family`` is any family of ``skyrl_numerics.models`` (the dense ``qwen3``, ``llama``,
``qwen2``, ``mistral`` too).

One invariant engine per ``--kv-cache`` format (the trainer simulates the same format).

``--forward-times`` also times each engine's model forward inside its worker (perf_counter
around ``model.forward``, decode steps only: steps with one token per prompt) and the step
period (one decode forward's start to the next), and reports medians in ms. A median over
hundreds of steps moves far less with the machine's drift than tokens/s, and the period minus
the forward is what the engine around the model costs. It sends a timing function to the workers,
which needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (set by the script for its own engines).
"""
from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--pause", type=float, default=1.5, help="seconds between turns")
    ap.add_argument("--family", default="qwen3_moe")
    ap.add_argument("--kv-cache", default="auto", help="comma-separated invariant cache formats")
    ap.add_argument("--config", default="{}",
                    help="JSON object of config overrides for the family's tiny model")
    ap.add_argument("--forward-times", action="store_true",
                    help="also time the model forward per decode step inside each worker")
    ap.add_argument("--real-dims", action="store_true",
                    help="the family's real-dims checkpoint (benchmarks/real_dims.py) instead of the tiny one")
    ap.add_argument("--engine-args", default="{}",
                    help="JSON object of extra engine arguments for every engine (both kinds)")
    ap.add_argument("--peak-rss", action="store_true",
                    help="report each engine's worker peak RSS (VmHWM) in GiB")
    ap.add_argument("--no-stock", action="store_true",
                    help="invariant engines only, no ratio: for a model stock vLLM CPU cannot run "
                         "(Nemotron-H's MoE: non-gated fused experts are GPU-only in vLLM 0.32)")
    ap.add_argument("--sequential", action="store_true",
                    help="one engine alive at a time: its rounds back to back, then closed")
    args = ap.parse_args()
    if args.forward_times or args.peak_rss:
        import os

        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"   # (to send _install_timer, _peak_rss)

    from skyrl_numerics.rollout.prompts import make_prompts
    from skyrl_numerics.models import build_tiny_model
    from skyrl_numerics.trainer import VLLMGenerator

    if args.real_dims:
        from real_dims import build       # (benchmarks/real_dims.py, beside this script)

        model_dir = build(args.family, **json.loads(args.config))
    else:
        model_dir = build_tiny_model(args.family, **json.loads(args.config))
    prompts = make_prompts(args.prompts, args.prompt_len, 512, seed=0)
    results = {}
    variants = ([] if args.no_stock else [("stock", {})]) + [
        (f"invariant-{kv}", {"batch_invariant": True, **({} if kv == "auto" else {"kv_cache": kv})})
        for kv in args.kv_cache.split(",")]
    gens = {}
    rates: dict[str, list[float]] = {name: [] for name, _ in variants}
    last = {}

    def start(name, kw):
        gens[name] = VLLMGenerator(model_dir, **kw, **json.loads(args.engine_args))
        gens[name].generate([[2, 3]], max_tokens=2)
        if args.forward_times:
            gens[name].llm.collective_rpc(_install_timer, args=(args.prompts,))

    def round_of(name, r):
        time.sleep(args.pause)
        t0 = time.perf_counter()
        last[name] = gens[name].generate(prompts, max_tokens=args.max_tokens, seed=r)
        rates[name].append(last[name].num_response_tokens / (time.perf_counter() - t0))

    for name, kw in variants:
        if args.sequential:          # measured (and summarized below) one engine at a time
            start(name, kw)
            for r in range(args.repeats):
                round_of(name, r)
            _summarize(args, name, kw, gens, last, rates, results, model_dir)
        else:
            start(name, kw)
    for r in range(args.repeats if not args.sequential else 0):
        for name, _ in variants:
            round_of(name, r)
    for name, kw in variants if not args.sequential else ():
        _summarize(args, name, kw, gens, last, rates, results, model_dir)
    if not args.no_stock:
        _ratios(args, variants, rates, results)
    print(json.dumps(results, indent=2))


def _summarize(args, name, kw, gens, last, rates, results, model_dir) -> None:
    """One engine's figures (tok/s, bitwise fraction against its trainer), then it closes."""
    import numpy as np

    from skyrl_numerics.invariant import from_checkpoint
    from skyrl_numerics.models import load_hf_model
    from skyrl_numerics.trainer import trainer_logprobs
    from skyrl_numerics.trainer.logprobs import invariant_trainer_logprobs

    ro = last[name]
    if name == "stock":
        lp = trainer_logprobs(load_hf_model(model_dir), ro).logprobs
    else:
        lp = invariant_trainer_logprobs(from_checkpoint(model_dir, kv_cache=kw.get("kv_cache")),
                                        ro).logprobs
    results[name] = {"tokens_per_s": max(rates[name]), "tokens_per_s_rounds": rates[name],
                     "frac_bitwise_equal": float(np.mean(lp == ro.rollout_logprobs)),
                     "mean_abs_gap": float(np.mean(np.abs(lp - ro.rollout_logprobs)))}
    if args.peak_rss:
        results[name]["worker_peak_rss_gib"] = gens[name].llm.collective_rpc(_peak_rss)[0]
    if args.forward_times:
        results[name]["worker_ms"] = _timing_summary(
            gens[name].llm.collective_rpc(_fetch_timer)[0], args.prompts)
    gens[name].close()


def _ratios(args, variants, rates, results) -> None:
    import numpy as np

    for name, _ in variants[1:]:
        results[f"ratio_{name}_over_stock"] = (results[name]["tokens_per_s"]
                                               / results["stock"]["tokens_per_s"])
        results[f"ratio_{name}_over_stock_median_of_rounds"] = float(np.median(
            [a / b for a, b in zip(rates[name], rates["stock"])]))
        if args.forward_times:
            for what in ("forward", "step"):
                results[f"{what}_ratio_stock_over_{name}"] = (
                    results["stock"]["worker_ms"][f"{what}_median"]
                    / results[name]["worker_ms"][f"{what}_median"])


def _install_timer(worker, tokens: int) -> int:
    """(In the worker.) Record (start, duration, tokens) of each model forward (the instance
    patch ``"model.forward"`` of ``vllm_patches.py``; kept for the engine's life)."""
    from skyrl_numerics.engine.vllm_patches import patch_instance

    model = worker.model_runner.model
    forward = model.forward
    times = model._skyrl_bench_times = []

    def timed(*a, **kw):
        ids = kw.get("input_ids", a[0] if a else None)
        t0 = time.perf_counter()
        out = forward(*a, **kw)
        if ids is not None:
            times.append((t0, time.perf_counter() - t0, int(ids.shape[0])))
        return out
    patch_instance(model, "forward", timed, what="model.forward")
    return 0


def _peak_rss(worker) -> float:
    """(In the worker.) This process's peak resident set (VmHWM), GiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def _fetch_timer(worker) -> list:
    return list(worker.model_runner.model._skyrl_bench_times)


def _timing_summary(rows, tokens: int) -> dict:
    """Forward ms per decode step (``tokens`` tokens: one per prompt), the decode step period
    (one decode forward's start to the next one's in the same batch, gaps under 0.25 s or 4 decode
    forward medians, whichever is longer — a real-dims forward can exceed 0.25 s: the whole
    engine step — scheduler, sampler, the worker round trip) and the forward of the other steps
    (prefill, at the start of each batch)."""
    import numpy as np

    start = np.array([r[0] for r in rows])
    fwd = np.array([r[1] for r in rows]) * 1e3
    dec = np.array([r[2] == tokens for r in rows])
    both = dec[1:] & dec[:-1]
    gaps = (np.diff(start) * 1e3)[both]
    period = gaps[gaps < max(250.0, 4 * float(np.median(fwd[dec])) if dec.any() else 0.0)]
    q = lambda a, p: float(np.percentile(a, p)) if a.size else float("nan")  # noqa: E731
    d = fwd[dec]
    return {"forward_median": q(d, 50), "forward_p25": q(d, 25), "forward_p75": q(d, 75),
            "step_median": q(period, 50), "rest_of_step_median": q(period, 50) - q(d, 50),
            "decode_steps": int(d.size), "prefill_forward_median": q(fwd[~dec], 50),
            "prefill_steps": int((~dec).sum())}


if __name__ == "__main__":
    main()
