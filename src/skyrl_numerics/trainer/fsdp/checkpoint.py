"""Trainer checkpoints: full (unsharded) weights + optimizer state, gathered to rank 0, written atomically.

Layout of a checkpoint directory::

    model.safetensors   trainer-named weights (HF names; LoRA adapters as ``.base.`` / ``.lora_A/B``)
    optimizer.pt        full AdamW state keyed by parameter name (``torch.save``; loads with weights_only)
    trainer_state.json  {"schema": "skyrl-numerics/trainer-checkpoint", "version": 1, "global_step": ..,
                         "world_size": .., "lora_modules": [..]}

Full state dicts make a checkpoint independent of the number of ranks (save with 2, load with 1
or 4): every rank reads the files on load and keeps its own shards. Rank 0 writes everything into
a temp directory next to ``path`` and renames it into place, so a crash never leaves a half
checkpoint under ``path``; an existing checkpoint is swapped out only after the new one is
complete.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from skyrl_numerics.atomic import atomic_dir
from skyrl_numerics.errors import InputError

__all__ = ["save_checkpoint", "load_checkpoint", "SCHEMA"]

SCHEMA = "skyrl-numerics/trainer-checkpoint"
VERSION = 1


def _barrier(trainer):
    if trainer._dist:
        import torch.distributed as dist

        dist.barrier()


def _optim_state(trainer, *, full: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(trainer.policy, trainer.optimizer,
                                    options=StateDictOptions(full_state_dict=full, cpu_offload=full))


def save_checkpoint(trainer, path: str | os.PathLike) -> Path:
    """Write ``trainer``'s weights and optimizer state to directory ``path`` (collective: call on all ranks)."""
    from safetensors.torch import save_file

    path = Path(path)
    model_sd = trainer.state_dict(full=True)
    optim_sd = _optim_state(trainer)
    if trainer.rank == 0:
        with atomic_dir(path, replace=True) as tmp:
            save_file({k: v.contiguous() for k, v in model_sd.items()}, str(tmp / "model.safetensors"),
                      metadata={"schema": SCHEMA})
            torch.save(_strip(optim_sd), tmp / "optimizer.pt")
            state = {"schema": SCHEMA, "version": VERSION, "global_step": trainer.global_step,
                     "world_size": trainer.world_size, "lora_modules": trainer.lora_modules}
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
            for f in tmp.iterdir():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
    _barrier(trainer)
    return path


def _strip(osd: dict) -> dict:
    """Optimizer state with the wrapper prefix ``lm.`` removed from parameter names."""
    return {"state": {k.removeprefix("lm."): v for k, v in osd["state"].items()},
            "param_groups": [{**g, "params": [p.removeprefix("lm.") for p in g["params"]]}
                             for g in osd["param_groups"]]}


def _prefix(osd: dict) -> dict:
    return {"state": {f"lm.{k}": v for k, v in osd["state"].items()},
            "param_groups": [{**g, "params": [f"lm.{p}" for p in g["params"]]} for g in osd["param_groups"]]}


def load_checkpoint(trainer, path: str | os.PathLike) -> dict:
    """Load weights and optimizer state saved by :func:`save_checkpoint` (collective); returns trainer_state."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    path = Path(path)
    for name in ("model.safetensors", "optimizer.pt", "trainer_state.json"):
        if not (path / name).is_file():
            raise InputError(f"checkpoint file missing: {path / name}", field=name, source=str(path))
    state = json.loads((path / "trainer_state.json").read_text())
    if state.get("schema") != SCHEMA or state.get("version") != VERSION:
        raise InputError(f"not a {SCHEMA} v{VERSION} checkpoint (schema {state.get('schema')!r}, "
                         f"version {state.get('version')!r})", field="trainer_state.json", source=str(path))
    sd = load_file(str(path / "model.safetensors"))
    expected = set(trainer.state_dict(full=False))
    missing, extra = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or extra:
        what = f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}"
        raise InputError(f"weights do not match the model: {what}", field="model.safetensors", source=str(path))
    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(trainer.policy, {f"lm.{k}": v for k, v in sd.items()}, options=opts)
    osd = torch.load(path / "optimizer.pt", weights_only=True)
    set_optimizer_state_dict(trainer.policy, trainer.optimizer, _prefix(osd), options=opts)
    trainer.global_step = int(state["global_step"])
    _barrier(trainer)
    return state
