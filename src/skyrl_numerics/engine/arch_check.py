"""Whether this host's vLLM can run a checkpoint: its architecture in vLLM's model registry and
every user engine argument one vLLM knows (checked before any engine starts)."""
from __future__ import annotations

import dataclasses

from skyrl_numerics.errors import InputError
from skyrl_numerics.host import vllm_version


def check_vllm_architecture(arch: str, engine_args: dict, src: str = "") -> None:
    """InputError unless vLLM's model registry has ``arch`` (or the Transformers backend is asked
    for), and every ``engine_args`` key is a vLLM engine argument."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.registry import ModelRegistry

    known_args = {f.name for f in dataclasses.fields(EngineArgs)}
    for k in engine_args:
        if k not in known_args:
            raise InputError(f"unknown vLLM engine argument {k!r}", field="engine-arg")
    if engine_args.get("model_impl") == "transformers":
        return
    if arch not in set(ModelRegistry.get_supported_archs()):
        raise InputError(f"architecture {arch!r} is not one vLLM {vllm_version()} can run (not in "
                         "its model registry; --engine-arg model_impl=\"transformers\" tries vLLM's "
                         "Transformers backend)", source=src or None, field="architectures")
