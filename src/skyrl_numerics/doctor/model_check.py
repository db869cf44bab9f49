"""Bring your own model: what the doctor checks about a checkpoint directory before any engine starts.

:func:`inspect_checkpoint` reads ``config.json`` (and only the headers of the weight files) and
returns a :class:`CheckpointInfo`: architecture, model type, MoE or dense (expert count), vocabulary,
stored dtype, parameter count, config hash, tokenizer present or not. Every problem is an
:class:`~skyrl_numerics.errors.InputError` naming the directory and what is wrong:

- not a checkpoint: no ``config.json``, unreadable JSON, no ``architectures``, no weight files;
- an architecture vLLM cannot run (not in vLLM's model registry, unless the engine is told to use
  its Transformers backend with ``--engine-arg model_impl=transformers``);
- a config transformers cannot build;
- a model that will not fit (:func:`check_memory`: not even the baseline row — its stock engine,
  then its trainer copy — fits the free memory, by :mod:`~skyrl_numerics.doctor.engine_memory`'s arithmetic);
- a prompts file (:func:`load_prompts_file`) that is malformed, empty, has ids outside the
  vocabulary, text without a tokenizer, or prompts too long for ``max_model_len``.

The parameter count is exact: the model is instantiated by transformers on the ``meta`` device
(no memory, no weights read).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skyrl_numerics.engine.arch_check import check_vllm_architecture
from skyrl_numerics.errors import InputError
from skyrl_numerics.hashing import json_key
from skyrl_numerics.hf_config import moe_dims
from skyrl_numerics.invariant.multimodal import text_fields, text_weight_name
from skyrl_numerics.safetensors_header import read_header

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


@dataclass
class CheckpointInfo:
    path: Path
    config: dict
    architecture: str
    model_type: str
    config_hash: str
    num_experts: int            # routed experts (0 = dense)
    vocab_size: int
    stored_dtype: str
    params: int | None = None
    has_tokenizer: bool = False
    weight_names: list = field(default_factory=list, repr=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    @property
    def model_config(self) -> dict:
        """The language model's fields: ``config`` itself, or a multimodal checkpoint's
        ``text_config`` (:func:`~skyrl_numerics.invariant.multimodal.text_fields`)."""
        return text_fields(self.config)

    def to_dict(self) -> dict:
        return {"path": str(self.path), "architecture": self.architecture,
                "model_type": self.model_type, "config_hash": self.config_hash,
                "moe": self.is_moe, "num_experts": self.num_experts,
                "vocab_size": self.vocab_size, "stored_dtype": self.stored_dtype,
                "params": self.params}

    def has_experts_named(self, pattern: str = "*.mlp.experts") -> bool:
        """Are there per-expert 2-D weights ``<pattern>.<e>.<proj>.weight`` (what the fake-quant
        serving checkpoints quantize)?"""
        import fnmatch

        return any(n.endswith(".weight") and n.count(".") >= 3
                   and fnmatch.fnmatchcase(n.rsplit(".", 3)[0], pattern)
                   and n.rsplit(".", 3)[1].isdigit() for n in self.weight_names)


def config_hash(config: dict) -> str:
    """sha256 (first 16 hex digits) of ``config.json`` as canonical JSON (sorted keys)."""
    return json_key(config)


_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def weight_headers(path: Path) -> dict[str, dict]:
    """Every safetensors tensor entry of the checkpoint, by name (headers only; see
    :func:`read_header`), with a sharded checkpoint's index checked against its shards."""
    src = str(path)
    files = sorted(path.glob("*.safetensors"))
    entries: dict[str, dict] = {}
    where: dict[str, str] = {}
    for f in files:
        for name, e in read_header(f, src).items():
            if name in entries:
                raise InputError(f"tensor {name!r} is in both {where[name]} and {f.name}",
                                 source=src, field="weights")
            entries[name], where[name] = e, f.name
    for idx in sorted(path.glob("*.safetensors.index.json")):
        try:
            wm = json.loads(idx.read_text()).get("weight_map")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
            raise InputError(f"{idx.name} is not a JSON object with a weight_map ({e})",
                             source=src, field="weights") from None
        if not isinstance(wm, dict):
            raise InputError(f"{idx.name}: 'weight_map' must be an object", source=src, field="weights")
        for name, shard in wm.items():
            if not isinstance(shard, str) or not (path / shard).is_file():
                raise InputError(f"{idx.name} maps {name!r} to shard {shard!r}, which is not in "
                                 "the directory", source=src, field="weights")
            if where.get(name) != shard:
                raise InputError(f"{idx.name} maps {name!r} to {shard}, but "
                                 + (f"it is in {where[name]}" if name in where else "no shard holds it"),
                                 source=src, field="weights")
    if not files and not list(path.glob("pytorch_model*.bin")):
        raise InputError("no weight files (*.safetensors or pytorch_model*.bin): not a checkpoint",
                         source=src, field="weights")
    return entries


def _check_weights_match_config(config: dict, entries: dict, src: str) -> None:
    """What the safetensors headers can show against config.json without building the model
    (checked only where the checkpoint uses the standard decoder names): the embedding and the
    lm-head (required when ``tie_word_embeddings`` is false) of shape ``[vocab_size,
    hidden_size]`` in a float dtype, and ``model.layers.<i>`` for every ``i <
    num_hidden_layers`` and no more (DeepSeek's MTP layers, ``num_nextn_predict_layers``, may
    follow); config numbers finite, ``num_hidden_layers >= 1``."""
    import math
    import re

    for k, v in config.items():
        if isinstance(v, float) and not math.isfinite(v):
            raise InputError(f"config.json: {k} is {v}, not a finite number", source=src, field=k)
        if (isinstance(v, int) and not isinstance(v, bool) and v < 0
                and (k.endswith(("_size", "_dim")) or k.startswith(("num_", "n_")))):
            raise InputError(f"config.json: {k} is {v}; a size or count cannot be negative",
                             source=src, field=k)
    L = config.get("num_hidden_layers")
    if L is not None and (isinstance(L, bool) or not isinstance(L, int) or L < 1):
        raise InputError(f"config.json: num_hidden_layers must be an integer >= 1, got {L!r}",
                         source=src, field="num_hidden_layers")
    V, H = config.get("vocab_size"), config.get("hidden_size")
    if "model.embed_tokens.weight" in entries:      # (the standard decoder layout)
        heads = ["model.embed_tokens.weight"]
        if "lm_head.weight" in entries:
            heads.append("lm_head.weight")
        elif config.get("tie_word_embeddings") is False:
            raise InputError("weight 'lm_head.weight' is missing (config.json has "
                             "tie_word_embeddings false)", source=src, field="lm_head.weight")
        quantized = bool(config.get("quantization_config"))
        for name in heads:
            e = entries[name]
            if isinstance(V, int) and isinstance(H, int) and e["shape"] != [V, H]:
                raise InputError(f"weight {name!r} has shape {e['shape']}; config.json's vocab_size "
                                 f"and hidden_size say [{V}, {H}]", source=src, field=name)
            if not quantized and e["dtype"] not in _FLOAT_DTYPES:
                raise InputError(f"weight {name!r} is {e['dtype']}, not a float dtype (and the "
                                 "config has no quantization_config)", source=src, field=name)
    layers = {int(m.group(1)) for n in entries for m in [re.match(r"model\.layers\.(\d+)\.", n)] if m}
    if layers and isinstance(L, int):
        extra = config.get("num_nextn_predict_layers") or 0
        extra = extra if isinstance(extra, int) and not isinstance(extra, bool) else 0
        missing = sorted(set(range(L)) - layers)
        if missing:
            raise InputError(f"config.json has num_hidden_layers {L}, but the weights have no "
                             f"model.layers.{missing[0]}", source=src, field="num_hidden_layers")
        if max(layers) >= L + extra:
            raise InputError(f"the weights have model.layers.{max(layers)}, but config.json has "
                             f"num_hidden_layers {L}" + (f" (+ {extra} MTP)" if extra else ""),
                             source=src, field="num_hidden_layers")


def inspect_checkpoint(path: str | os.PathLike, *, engine_args: dict | None = None,
                       count_params: bool = True) -> CheckpointInfo:
    """Check that ``path`` is an HF checkpoint that transformers and vLLM can load (see the
    module docstring); raises InputError naming the problem."""
    path = Path(path)
    src = str(path)
    if not path.is_dir():
        raise InputError("not a directory" if path.exists() else "no such directory", source=src)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise InputError("no config.json: not a Hugging Face checkpoint directory", source=src)
    try:
        config = json.loads(cfg_file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InputError(f"config.json is not valid JSON ({e})", source=src) from None
    if not isinstance(config, dict):
        raise InputError("config.json is not a JSON object", source=src)
    archs = config.get("architectures")
    if not (isinstance(archs, list) and len(archs) == 1 and isinstance(archs[0], str)):
        raise InputError(f"config.json needs exactly one entry in 'architectures', got {archs!r}",
                         source=src, field="architectures")
    arch = archs[0]
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise InputError("config.json has no 'model_type'", source=src, field="model_type")
    entries = weight_headers(path)
    names = list(entries)
    text = text_fields(config)      # a multimodal checkpoint's language model (its text_config)
    if text is not config:
        entries = {t: e for n, e in entries.items() if (t := text_weight_name(n)) is not None}
    _check_weights_match_config(text, entries, src)
    vocab = text.get("vocab_size")
    if vocab is None and isinstance(config.get("text_config"), dict):
        vocab = config["text_config"].get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 2:
        raise InputError(f"config.json: vocab_size must be an integer >= 2, got {vocab!r}",
                         source=src, field="vocab_size")
    experts = moe_dims(text).num_experts
    stored = config.get("torch_dtype") or config.get("dtype") or "float32"
    stored = str(stored).replace("torch.", "")
    check_vllm_architecture(arch, engine_args or {}, src)
    info = CheckpointInfo(path=path, config=config, architecture=arch, model_type=model_type,
                          config_hash=config_hash(config), num_experts=experts, vocab_size=vocab,
                          stored_dtype=stored, weight_names=names,
                          has_tokenizer=any((path / f).exists() for f in _TOKENIZER_FILES))
    if count_params:
        info.params = count_parameters(path, src)
    return info


def count_parameters(path: Path, src: str = "") -> int:
    """Parameters of the model ``config.json`` describes, instantiated on the meta device."""
    import warnings

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = AutoConfig.from_pretrained(str(path), local_files_only=True)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(cfg)
    except Exception as e:  # transformers raises ValueError/KeyError/TypeError/... here
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputError(f"transformers cannot build this config ({type(e).__name__}: {msg})",
                         source=src or str(path), field="config.json") from None
    n = sum(p.numel() for p in model.parameters())
    del model
    return int(n)


def dtype_bytes(dtype: str, src: str = "") -> int:
    d = str(dtype).replace("torch.", "")
    if d not in _DTYPE_BYTES:
        raise InputError(f"unsupported dtype {dtype!r} (expected one of {sorted(_DTYPE_BYTES)})",
                         source=src or None, field="dtype")
    return _DTYPE_BYTES[d]


def check_memory(info: CheckpointInfo, *, engine_dtype: str, trainer_dtype: str, n_prompts: int,
                 seq_len: int, max_model_len: int, engine_args: dict | None = None,
                 available: int | None = None, total: int | None = None) -> int:
    """InputError if not even one doctor row fits in RAM; returns the bytes that row needs.

    The same arithmetic as the doctor's memory plan (:mod:`skyrl_numerics.doctor.engine_memory`): the
    plan runs a row alone when the table does not fit together, sampling before scoring, so the
    least a run needs is ``max(E, T) + HEADROOM`` — ``E`` the stock engine of the baseline row
    (weights from the safetensors headers + the KV cache the run's ``n_prompts`` sequences of
    ``seq_len`` need + process overhead, or what a memory knob the user set makes it take), ``T``
    the trainer copy in ``trainer_dtype`` (:func:`~skyrl_numerics.doctor.trainer_memory.copy_need`: its
    parameters and buffers + the larger of its load and scoring transients). Rows that need more (a float32 trainer copy, a second
    engine beside the first) are planned alone or skipped with their sizes, not refused here."""
    from skyrl_numerics.doctor import engine_memory as em

    engine_args = dict(engine_args or {})
    params = info.params or em.checkpoint_params(info.path)[0]
    t, f = em.free_memory()
    avail = f if available is None else available
    total = t if total is None else total
    need = em.engine_need(info.model_config, params, dtype=engine_dtype, n_prompts=n_prompts,
                          seq_len=seq_len, max_model_len=max_model_len,
                          kv_cache_dtype=engine_args.get("kv_cache_dtype", "auto"))
    if "kv_cache_memory_bytes" in engine_args:
        need = em.EngineNeed(need.weights, int(engine_args["kv_cache_memory_bytes"]))
        engine = need.total
    elif "gpu_memory_utilization" in engine_args:
        engine = em.footprint(need, {}, total, share=float(engine_args["gpu_memory_utilization"]))
    else:
        settings = em.engine_settings([need], engine_args, total=total, free=avail)
        engine = em.footprint(need, settings, total)
    dtype_bytes(trainer_dtype, "--dtype")   # a clear error for a nonsense dtype
    from .trainer_memory import copy_need

    trainer = copy_need(info, (trainer_dtype, None), n_prompts=n_prompts, seq_len=seq_len)
    least = max(engine, trainer) + em.HEADROOM
    if least > avail:
        raise InputError(
            f"model will not fit in memory: its smallest row needs {em.gib(least)} (stock engine "
            f"{engine_dtype} {em.gib(engine)}: weights {em.gib(need.weights)}, KV {em.gib(need.kv)}, "
            f"overhead {em.gib(need.overhead)}; then the trainer {trainer_dtype} copy "
            f"{em.gib(trainer)} with its scoring; + {em.gib(em.HEADROOM)} headroom), {em.gib(avail)} available",
            source=str(info.path), field="memory")
    return least


def _load_tokenizer(info: CheckpointInfo):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(info.path), local_files_only=True)


def load_prompts_file(file: str | os.PathLike, info: CheckpointInfo, *, max_tokens: int,
                      max_model_len: int) -> list[list[int]]:
    """Prompts from a jsonl file, one per line: a list of token ids, ``{"prompt_token_ids": [...]}``,
    or (when the checkpoint has a tokenizer) a string / ``{"prompt": str}`` / ``{"text": str}``.
    Blank lines are skipped. Errors name the file, the line (1-based) and the index."""
    src = str(file)
    for name, v in (("max_tokens", max_tokens), ("max_model_len", max_model_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(f"{name} must be an integer >= 1, got {v!r}", field=name.replace("_", "-"))
    try:
        text = Path(file).read_text(encoding="utf-8")
    except IsADirectoryError:
        raise InputError("is a directory, expected a jsonl file", source=src) from None
    except FileNotFoundError:
        raise InputError("no such file", source=src) from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read ({e})", source=src) from None
    tok = None
    out: list[list[int]] = []
    # lines end at "\n" only (splitlines() also breaks at \v, \x1c, \u2028...: wrong line numbers)
    for ln, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            obj: Any = json.loads(line)
        except ValueError as e:
            raise InputError(f"line {ln}: not valid JSON ({e})", source=src) from None
        if isinstance(obj, dict):
            keys = [k for k in ("prompt_token_ids", "prompt", "text") if k in obj]
            if len(keys) != 1:
                raise InputError(f"line {ln}: expected one of 'prompt_token_ids', 'prompt', 'text', "
                                 f"got keys {sorted(obj)}", source=src)
            obj = obj[keys[0]]
        if isinstance(obj, str):
            if not info.has_tokenizer:
                raise InputError(f"line {ln}: a text prompt, but {info.path} has no tokenizer "
                                 "(give token ids)", source=src)
            if tok is None:
                try:
                    tok = _load_tokenizer(info)
                except Exception as e:
                    raise InputError(f"the tokenizer in {info.path} does not load ({type(e).__name__})",
                                     source=src) from None
            ids = list(tok.encode(obj))
        elif isinstance(obj, list):
            ids = obj
        else:
            raise InputError(f"line {ln}: expected a list of token ids or a text prompt, got "
                             f"{type(obj).__name__}", source=src)
        if not ids:
            raise InputError(f"line {ln}: empty prompt", source=src)
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool):
                raise InputError(f"line {ln}: token id {t!r} is not an integer", source=src,
                                 field="prompt_token_ids", index=i)
            if not 0 <= t < info.vocab_size:
                raise InputError(f"line {ln}: token id {t} outside the vocabulary "
                                 f"[0, {info.vocab_size})", source=src, field="prompt_token_ids",
                                 index=i)
        if len(ids) + max_tokens > max_model_len:
            raise InputError(f"line {ln}: prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) "
                             f"exceeds max_model_len {max_model_len}", source=src)
        out.append(ids)
    if not out:
        raise InputError("no prompts in the file", source=src)
    return out
