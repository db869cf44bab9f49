"""``skyrl-numerics train``: the RL loop from the command line (``trainer/loop.py``), with the seed
recipes (``--recipe``, ``trainer/seed_recipes.py``); writes ``OUT/train.json`` and ``OUT/train.png``.

Everything the arguments say is checked (and refused with one line naming the field) before any
engine starts; then one :class:`~skyrl_numerics.trainer.loop.LoopRun` runs and its table is
printed."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from skyrl_numerics.errors import InputError


def cmd_train(args) -> int:
    from skyrl_numerics.doctor.report import check_out_dir
    from skyrl_numerics.trainer.loop import LoopRun

    recipe = seed_recipe(args)
    names = config_names(args, recipe)
    check_out_dir(args.out)              # before any engine starts
    task, env = task_and_env(args)
    check_model_args(args, recipe, names)
    model_dir = checkpoint(args)
    run = LoopRun(model_dir, loop_configs(args, recipe, names, model_dir), loop_settings(args, recipe),
                  placement(args), task=task, env=env, work_dir=Path(args.out) / "sync",
                  progress=not args.no_progress)
    res, log_path = run_logged(args, run)
    report(args, recipe, res, log_path)
    return 0


# ---- what the arguments ask for, checked before any engine starts -----------------------------
def seed_recipe(args):
    """The ``--recipe`` with its ``--recipe-set`` overrides (every field checked), or None."""
    if not (args.recipe or args.recipe_set):
        return None
    from skyrl_numerics.trainer.seed_recipes import get_recipe

    if not args.recipe:
        raise InputError("--recipe-set without --recipe", field="recipe-set")
    return get_recipe(args.recipe, args.recipe_set)


def config_names(args, recipe) -> list[str]:
    from skyrl_numerics.trainer.loop import CONFIGS

    default = "published,bitwise" if recipe else "plain,aligned,bitwise"
    names = [c.strip() for c in (args.configs or default).split(",") if c.strip()]
    unknown = [n for n in names if n not in CONFIGS and recipe is None]
    if unknown:
        raise InputError(f"unknown configuration(s) {unknown}; known: {sorted(CONFIGS)}", field="configs")
    return names


def task_and_env(args) -> tuple:
    """``--reward`` (a task; None: the loop's default) and ``--env`` (multi-turn)."""
    from skyrl_numerics.trainer.reward import RewardTask, load_reward

    task = RewardTask(load_reward(args.reward), name=args.reward) if args.reward else None
    env = None
    if args.env:
        if args.multi_turn < 2:
            raise InputError("--env without --multi-turn N (N >= 2): an environment answers "
                             "between model turns", field="env")
        env = load_reward(args.env, field="env")
    return task, env


def check_model_args(args, recipe, names) -> None:
    if args.trained and (args.model or args.server):
        raise InputError("--trained builds the trained tiny --family model; not with --model / "
                         "--server", field="trained")
    if args.model and (args.server or args.family != "qwen3_moe"):
        raise InputError("--model DIR with --server or --family: the server / family names the "
                         "checkpoint", field="model")
    if args.model:
        from skyrl_numerics.doctor.model_check import inspect_checkpoint

        inspect_checkpoint(args.model)   # a clear error before any engine starts
    if recipe is not None and args.backend == "megatron" and "published" in names and recipe.numerics.lora_rank:
        raise InputError(f"recipe {recipe.name!r} trains LoRA adapters; the megatron trainer has no "
                         "LoRA: run the published config with --backend fsdp", field="backend")
    if recipe is not None and args.kv_cache:
        raise InputError("--recipe sets the engine's cache format itself (--recipe-set "
                         "kv_cache=...); not with --kv-cache", field="recipe")


def servers(args) -> list[str]:
    return [u.strip() for u in args.server.split(",") if u.strip()] if args.server else []


def checkpoint(args) -> str:
    """The checkpoint the trainer loads: the one the server serves, ``--model``, or the tiny
    ``--family`` model."""
    if args.server:
        from skyrl_numerics.engine.remote import RemoteGenerator

        if args.ray:
            raise InputError("--server and --ray: the server is the generator", field="ray")
        model_dir = RemoteGenerator(servers(args)[0], api_key=args.api_key).model_dir
        if not (Path(model_dir) / "config.json").is_file():
            raise InputError(f"the server serves {model_dir}, which is not a checkpoint directory "
                             "on this machine (the trainer loads it)", field="server")
        return model_dir
    if args.model:
        return args.model
    if args.trained:
        from skyrl_numerics.trained_models import build_trained_model

        return build_trained_model(args.family)
    from skyrl_numerics.models import build_tiny_model

    return build_tiny_model(args.family, seed=args.seed)


def loop_configs(args, recipe, names, model_dir) -> list:
    """The named configurations (``--kv-cache`` on the bitwise one), or the recipe's, its plan
    built for the checkpoint and checked before any engine starts; ``--recompute-old-every`` on
    each (the bitwise ones use it)."""
    if recipe is not None:
        from skyrl_numerics.trainer.seed_recipes import loop_configs as recipe_configs

        cfgs = recipe_configs(recipe, model_dir, names)
    else:
        from skyrl_numerics.trainer.loop import CONFIGS

        cfgs = [dataclasses.replace(CONFIGS[n], kv_cache=args.kv_cache) if args.kv_cache and CONFIGS[n].bitwise
                else CONFIGS[n] for n in names]
    every = getattr(args, "recompute_old_every", None)
    return cfgs if every is None else [dataclasses.replace(c, recompute_old_every=every) for c in cfgs]


def loop_settings(args, recipe):
    from skyrl_numerics.trainer.loop import LoopSettings

    return LoopSettings(steps=args.steps, prompts_per_step=args.prompts,
                        samples_per_prompt=args.samples or (recipe.samples_per_prompt if recipe else 4),
                        max_tokens=args.max_tokens, seed=args.seed, off_policy=1 if args.async_ else 0,
                        measure_grad=not args.no_grad, turns=args.multi_turn)


def placement(args):
    from skyrl_numerics.trainer.loop import LoopPlacement

    urls = servers(args)
    return LoopPlacement(backend=args.backend, tp=args.tp, ep=args.ep, dp=args.dp, replicas=args.replicas,
                         use_ray=args.ray, server=urls if len(urls) > 1 else args.server, api_key=args.api_key)


# ---- the run and its report ----------------------------------------------------------------------
def run_logged(args, run) -> tuple:
    """Run the loop with vLLM's log captured; on a failure the log is kept and named."""
    from skyrl_numerics.cli import engine_log
    from skyrl_numerics.trainer.loop import run_loop

    out = Path(args.out)
    with engine_log(args) as elog:
        try:
            res = run_loop(run)
        except InputError:
            raise
        except BaseException:
            if not elog.verbose:
                print(f"train failed; vLLM log: {elog.keep(out / 'vllm.log')}", file=elog.terminal)
            raise
        return res, (None if elog.verbose else elog.keep(out / "vllm.log"))


def report(args, recipe, res, log_path) -> None:
    """The table on the terminal, ``train.json`` and ``train.png``."""
    from skyrl_numerics.cli import make_console
    from skyrl_numerics.doctor.report import plain, write_json
    from skyrl_numerics.trainer.loop_report import write_loop_plot

    out = Path(args.out)
    console = make_console()
    console.print(table(args, recipe, res))
    if res.host.get("isa_warning"):
        console.print(res.host["isa_warning"], markup=False)
    write_json(out / "train.json", res.to_dict())
    write_loop_plot(out / "train.png", res)
    console.print(f"wrote {plain(out / 'train.json')}, {plain(out / 'train.png')}"
                  + (f", {plain(log_path)}" if log_path else ""))


def table(args, recipe, res):
    """One row per configuration and step."""
    from rich.table import Table

    what = (f"the model at {args.server}" if args.server else args.model if args.model
            else f"the {'trained ' if args.trained else ''}tiny {args.family}") + (f", recipe {recipe.name}" if recipe else "")
    t = Table(title=f"GRPO on {what} (real vLLM generator, delta weight sync)")
    turns = any("gap_per_turn_max_abs" in r for rows in res.history.values() for r in rows)
    for col in (("config", "step", "reward", "mean |Δ|", "max |Δ|", "bitwise =", "F(2)", "KL k3",
                 "grad cos", "grad rel.err", "clipfrac", "sync kB (zstd XOR)", "engine update s")
                + (("max |Δ| by turn",) if turns else ())
                + (("TIS clip", "gen / old lp / train / sync s") if recipe else ())):
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
                         f"{r['time_generate_s']:.1f} / {r['time_old_logprobs_s']:.1f} / {r['time_train_s']:.1f}"
                         f" / {r['time_sync_s']:.2f}"]
                        if recipe else []))
    return t
