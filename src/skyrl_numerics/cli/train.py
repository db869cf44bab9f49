"""``skyrl-numerics train``: the RL loop from the command line (``trainer/loop.py``), with the seed
recipes (``--recipe``, ``trainer/seed_recipes.py``); writes ``OUT/train.json`` and ``OUT/train.png``."""
from __future__ import annotations

from pathlib import Path

from skyrl_numerics.errors import InputError


def cmd_train(args) -> int:
    from skyrl_numerics.cli import make_console, engine_log

    from skyrl_numerics.models import build_tiny_model
    from skyrl_numerics.doctor.report import check_out_dir, plain, write_json
    from skyrl_numerics.trainer.loop import CONFIGS, LoopSettings, run_loop
    from skyrl_numerics.trainer.loop_report import write_loop_plot

    names = [c.strip() for c in (args.configs or ("published,bitwise" if args.recipe else
                                                 "plain,aligned,bitwise")).split(",") if c.strip()]
    recipe = None
    if args.recipe or args.recipe_set:
        from skyrl_numerics.trainer.seed_recipes import get_recipe

        if not args.recipe:
            raise InputError("--recipe-set without --recipe", field="recipe-set")
        recipe = get_recipe(args.recipe, args.recipe_set)   # fields checked before anything starts
    unknown = [n for n in names if n not in CONFIGS and recipe is None]
    if unknown:
        raise InputError(f"unknown configuration(s) {unknown}; known: {sorted(CONFIGS)}",
                         field="configs")
    check_out_dir(args.out)              # before any engine starts
    task = None
    if args.reward:
        from skyrl_numerics.trainer.reward import RewardTask, load_reward

        task = RewardTask(load_reward(args.reward), name=args.reward)
    env = None
    if args.env:
        from skyrl_numerics.trainer.reward import load_reward

        if args.multi_turn < 2:
            raise InputError("--env without --multi-turn N (N >= 2): an environment answers "
                             "between model turns", field="env")
        env = load_reward(args.env, field="env")
    if args.model and (args.server or args.family != "qwen3_moe"):
        raise InputError("--model DIR with --server or --family: the server / family names the "
                         "checkpoint", field="model")
    if args.model:
        from skyrl_numerics.doctor.model_check import inspect_checkpoint

        inspect_checkpoint(args.model)   # a clear error before any engine starts
    samples = args.samples or (recipe.samples_per_prompt if recipe else 4)
    settings = LoopSettings(steps=args.steps, prompts_per_step=args.prompts,
                            samples_per_prompt=samples, max_tokens=args.max_tokens,
                            seed=args.seed, off_policy=1 if args.async_ else 0,
                            measure_grad=not args.no_grad, turns=args.multi_turn)
    if recipe is not None and args.backend == "megatron" and "published" in names and recipe.lora_rank:
        raise InputError(f"recipe {recipe.name!r} trains LoRA adapters; the megatron trainer has no "
                         "LoRA: run the published config with --backend fsdp", field="backend")
    if recipe is not None and args.kv_cache:
        raise InputError("--recipe sets the engine's cache format itself (--recipe-set "
                         "kv_cache=...); not with --kv-cache", field="recipe")
    configs = [CONFIGS[n] for n in names] if recipe is None else []
    if args.kv_cache:
        import dataclasses

        configs = [dataclasses.replace(c, kv_cache=args.kv_cache) if c.bitwise else c
                   for c in configs]
    out = Path(args.out)
    model_dir = None
    if args.server:
        from skyrl_numerics.engine.remote import RemoteGenerator

        if args.ray:
            raise InputError("--server and --ray: the server is the generator", field="ray")
        servers = [u.strip() for u in args.server.split(",") if u.strip()]
        model_dir = RemoteGenerator(servers[0], api_key=args.api_key).model_dir
        if not (Path(model_dir) / "config.json").is_file():
            raise InputError(f"the server serves {model_dir}, which is not a checkpoint directory "
                             "on this machine (the trainer loads it)", field="server")
    if recipe is not None:   # the plan for the checkpoint, checked before any engine starts
        from skyrl_numerics.trainer.seed_recipes import loop_configs

        configs = loop_configs(recipe, model_dir or args.model
                               or build_tiny_model(args.family, seed=args.seed), names)
    with engine_log(args) as elog:
        try:
            res = run_loop(model_dir or args.model or build_tiny_model(args.family, seed=args.seed),
                           configs, settings, use_ray=args.ray, work_dir=out / "sync", task=task,
                           progress=not args.no_progress, backend=args.backend,
                           server=(servers if args.server and len(servers) > 1 else args.server),
                           api_key=args.api_key, tp=args.tp, ep=args.ep, replicas=args.replicas,
                           dp=args.dp, env=env)
        except InputError:
            raise
        except BaseException:
            if not elog.verbose:
                print(f"train failed; vLLM log: {elog.keep(out / 'vllm.log')}", file=elog.terminal)
            raise
        log_path = None if elog.verbose else elog.keep(out / "vllm.log")
    console = make_console()
    from rich.table import Table

    what = (f"the model at {args.server}" if args.server else args.model if args.model
            else f"the tiny {args.family}") + (f", recipe {recipe.name}" if recipe else "")
    t = Table(title=f"GRPO on {what} (real vLLM generator, delta weight sync)")
    turns = any("gap_per_turn_max_abs" in r for rows in res.history.values() for r in rows)
    for col in (("config", "step", "reward", "mean |Δ|", "max |Δ|", "bitwise =", "F(2)", "KL k3",
                 "grad cos", "grad rel.err", "clipfrac", "sync kB (zstd XOR)", "engine update s")
                + (("max |Δ| by turn",) if turns else ())
                + (("TIS clip", "gen / train / sync s") if recipe else ())):
        t.add_column(col, justify="right")
    fmt = lambda r, k, f: format(r[k], f) if k in r else "-"  # noqa: E731
    for name, rows in res.history.items():
        for r in rows:
            t.add_row(name, str(r["step"]), f"{r['reward']:.3f}", f"{r['gap_mean_abs']:.2e}",
                      f"{r['gap_max_abs']:.2e}", f"{r['gap_frac_bitwise_equal']:.0%}",
                      f"{r['gap_F2']:.1%}", f"{r['gap_kl_k3']:.2e}",
                      fmt(r, "grad_cos_onpolicy", ".4f"), fmt(r, "grad_relerr_onpolicy", ".3f"),
                      f"{r['clipfrac']:.3f}",
                      f"{r['sync_payload_bytes'] / 1e3:.1f}", f"{r['engine_update_s']:.2f}",
                      *(([" ".join(f"{x:.1e}" for x in r.get("gap_per_turn_max_abs", []))])
                        if turns else []),
                      *([fmt(r, "tis_clip_frac", ".2%"),
                         f"{r['time_generate_s']:.1f} / {r['time_train_s']:.1f} / {r['time_sync_s']:.2f}"]
                        if recipe else []))
    console.print(t)
    if res.host.get("isa_warning"):
        console.print(res.host["isa_warning"], markup=False)
    write_json(out / "train.json", res.to_dict())
    write_loop_plot(out / "train.png", res)
    console.print(f"wrote {plain(out / 'train.json')}, {plain(out / 'train.png')}"
                  + (f", {plain(log_path)}" if log_path else ""))
    return 0
