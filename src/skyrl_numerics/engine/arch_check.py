"""Whether this host's vLLM can run a checkpoint: its architecture in vLLM's model registry and
every user engine argument one vLLM knows (checked before any engine starts)."""
from __future__ import annotations

import dataclasses
import importlib

from skyrl_numerics.errors import InputError
from skyrl_numerics.host import on_gpu, vllm_version

# architectures in vLLM's registry that its CPU build cannot start, with vLLM's own error
CPU_STOCK_BLOCKED = {
    "DeepseekV32ForCausalLM": (
        "its MLA layer asks for a sparse attention backend and vllm/platforms/cpu.py "
        "(get_attn_backend_cls) raises NotImplementedError: Sparse Attention is not supported on "
        "CPU; the batch-invariant path runs it (family deepseek_v32)"),
}


# architectures whose vLLM model module imports an optional package at import time, on any
# device: vLLM's qwen3_5.py imports qwen3_vl.py, which imports transformers' Qwen2-VL image
# processor, which imports torchvision (without it vLLM's registry fails to inspect the
# architecture: "Model architectures [...] failed to be inspected", ModuleNotFoundError: No
# module named 'torchvision')
STOCK_NEEDS = {arch: "torchvision" for arch in (
    "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
    # the hub's multimodal Qwen3.5: the same vLLM module (its vision tower needs it too)
    "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")}


def missing_stock_import(arch: str) -> str | None:
    """The error importing the package vLLM's model module for ``arch`` needs (one line), or
    None (nothing needed, or it imports)."""
    need = STOCK_NEEDS.get(arch)
    if need is None:
        return None
    try:
        importlib.import_module(need)
    except (ImportError, OSError, RuntimeError) as e:   # absent, or broken (a CUDA wheel, CPU torch)
        return f"{type(e).__name__}: {e}"
    return None


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


def stock_blocked_reason(arch: str) -> str | None:
    """Why stock vLLM on this host cannot run ``arch`` (one line), or None."""
    missing = missing_stock_import(arch)
    if missing:
        return (f"stock vLLM {vllm_version()} cannot import its model for {arch}: it needs "
                f"{STOCK_NEEDS[arch]} ({missing}); the batch-invariant path runs it")
    if arch not in CPU_STOCK_BLOCKED or on_gpu():
        return None
    return f"stock vLLM {vllm_version()} on CPU cannot run {arch}: {CPU_STOCK_BLOCKED[arch]}"


def stock_config_problem(hf_config: dict) -> tuple[str, str] | None:
    """``(field, why)`` of a config setting stock vLLM's model for its architecture would not
    honour — it would serve another model than the checkpoint, silently — or None (any platform).

    Qwen2: vLLM's ``Qwen2Attention`` takes ``head_dim = hidden_size // num_attention_heads`` and
    ignores ``config.head_dim`` (HF honours it); with another ``head_dim`` its q/k/v loaders slice
    the weights to the wrong rows (measured on the tiny Qwen2, head_dim 64 ≠ 128 / 4: engine vs HF
    mean |Δlogprob| 0.57 in `train --configs aligned`, against 2.5e-3 for the same-shaped Llama)."""
    archs = hf_config.get("architectures") or [None]
    if archs[0] == "Qwen2ForCausalLM" and hf_config.get("head_dim") is not None:
        heads, hidden = hf_config.get("num_attention_heads"), hf_config.get("hidden_size")
        if heads and hidden and int(hf_config["head_dim"]) != hidden // heads:
            return "head_dim", (f"stock vLLM's Qwen2ForCausalLM ignores head_dim={hf_config['head_dim']} "
                                f"(it uses hidden_size // num_attention_heads = {hidden // heads}) and "
                                "would serve another model; the batch-invariant path honours it")
    return None


def check_stock_architecture(hf_config: dict, engine_args: dict | None = None,
                             src: str = "") -> None:
    """InputError before a stock engine starts on a checkpoint this host's vLLM cannot run
    (:data:`CPU_STOCK_BLOCKED`) or would run as another model (:func:`stock_config_problem`);
    vLLM's Transformers backend is not judged here."""
    if (engine_args or {}).get("model_impl") == "transformers":
        return
    archs = hf_config.get("architectures") or []
    why = stock_blocked_reason(archs[0]) if len(archs) == 1 else None
    if why:
        raise InputError(why, source=src or None, field="architectures")
    bad = stock_config_problem(hf_config)
    if bad:
        raise InputError(bad[1], source=src or None, field=bad[0])
