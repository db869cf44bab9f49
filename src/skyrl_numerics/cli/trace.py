"""``skyrl-numerics trace``: the layer-by-layer tracer (``skyrl_numerics.doctor.trace``) from the
command line — two sides, the same sequences, the first module where they part; the table on
stdout, ``trace.json`` and ``trace.png`` in ``--out``.

    skyrl-numerics trace --model DIR --sides hf,vllm [--per-op] [--prompts N] [--out DIR]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from skyrl_numerics.errors import InputError
from skyrl_numerics.models import FAMILIES


#: the side names of ``doctor.trace.SIDES`` (for --help, without importing the tracer)
SIDE_NAMES = ("hf", "hf-mode", "invariant", "vllm", "vllm-invariant", "vllm-serve")


def add_parser(sub) -> argparse.ArgumentParser:
    t = sub.add_parser("trace", help="where two forwards of the same tokens first part, layer by "
                                     "layer (first divergence, its size, its growth)")
    t.add_argument("--model", default=None, metavar="DIR", help="a Hugging Face checkpoint")
    t.add_argument("--family", default=None, choices=FAMILIES,
                   help="build and trace this tiny model instead of --model")
    t.add_argument("--sides", default="hf,vllm",
                   help=f"two of {', '.join(SIDE_NAMES)}, comma-separated (default hf,vllm)")
    t.add_argument("--per-op", action="store_true",
                   help="also q/k/v, attention core and output, norms, router logits and choices, "
                        "MLP / MoE output")
    t.add_argument("--prompts", type=int, default=4, help="sequences (seeded random ids)")
    t.add_argument("--prompt-len", type=int, default=16)
    t.add_argument("--decode", type=int, default=0,
                   help="engine sides also generate this many greedy tokens (traces decode "
                        "steps; the other side runs the engine's tokens)")
    t.add_argument("--keep-tensors", action="store_true",
                   help="keep each traced row's values (max|Δ|, ulps, share of elements); "
                        "default: digests and stats only")
    t.add_argument("--server", default=None, metavar="URL",
                   help="the vllm-serve side: a server started by skyrl-numerics serve (dev mode) "
                        "serving --model DIR")
    t.add_argument("--api-key", default=None, help="the server's API key (default $VLLM_API_KEY)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", default="artifacts/trace")
    t.add_argument("--verbose", action="store_true",
                   help="show vLLM's logs here instead of writing them to OUT/vllm.log")
    return t


def _model_dir(args) -> Path:
    """The checkpoint: ``--model`` checked (one line naming what is wrong), or the tiny family."""
    if args.model and args.family:
        raise InputError("give --model DIR or --family NAME, not both", field="model")
    if args.family or not args.model:
        from skyrl_numerics.models import build_tiny_model

        return Path(build_tiny_model(args.family or "qwen3_moe", seed=args.seed))
    from skyrl_numerics.doctor.model_check import inspect_checkpoint

    return Path(inspect_checkpoint(args.model, count_params=False).path)


def cmd_trace(args, console_for, engine_log) -> int:
    from skyrl_numerics.doctor.report import check_out_dir, plain
    from skyrl_numerics.doctor.trace import ENGINE_SIDES, parse_sides, run_trace

    sides = parse_sides(args.sides)          # bad names: one line, before any work
    if any(s.kind == "vllm-serve" for s in sides) != bool(args.server):
        raise InputError("the vllm-serve side and --server URL go together", field="server")
    if args.prompts < 1 or args.prompt_len < 1 or args.decode < 0:
        raise InputError("--prompts and --prompt-len must be >= 1, --decode >= 0",
                         field="prompts")
    out = check_out_dir(args.out, names=("trace.json", "trace.png"))
    model_dir = _model_dir(args)
    engines = any(s.kind in ENGINE_SIDES for s in sides)
    for s in sides:
        if s.kind == "vllm-serve":
            from skyrl_numerics.engine.remote import RemoteGenerator

            s.model = RemoteGenerator(args.server, api_key=args.api_key, model_dir=str(model_dir))
    with engine_log(args) as elog:
        console = console_for(elog.terminal)
        try:
            res = run_trace(model_dir, sides, per_op=args.per_op, n_prompts=args.prompts,
                            prompt_len=args.prompt_len, decode=args.decode,
                            keep_tensors=args.keep_tensors, seed=args.seed)
        except InputError:
            raise
        except BaseException:
            if engines and not elog.verbose:
                console.print(f"trace failed; vLLM log: {plain(elog.keep(out / 'vllm.log'))}")
            raise
        console.print(res.table(), markup=False, highlight=False)
        res.write(out)
        wrote = [out / "trace.json", out / "trace.png"]
        if engines and not elog.verbose:
            wrote.append(elog.keep(out / "vllm.log"))
        console.print("wrote " + ", ".join(plain(p) for p in wrote), markup=False)
    return 0
