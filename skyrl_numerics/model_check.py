"""Bring your own model: what the doctor checks about a checkpoint directory before any engine starts.

:func:`inspect_checkpoint` reads ``config.json`` (and only the headers of the weight files) and
returns a :class:`CheckpointInfo`: architecture, model type, MoE or dense (expert count), vocabulary,
stored dtype, parameter count, config hash, tokenizer present or not. Every problem is an
:class:`~skyrl_numerics.errors.InputError` naming the directory and what is wrong:

- not a checkpoint: no ``config.json``, unreadable JSON, no ``architectures``, no weight files;
- an architecture vLLM cannot run (not in vLLM's model registry, unless the engine is told to use
  its Transformers backend with ``--engine-arg model_impl=transformers``);
- a config transformers cannot build;
- a model that will not fit (:func:`check_memory`: parameters x bytes per parameter for the engine
  copy and every trainer copy the selected rows load, against ``MemAvailable``);
- a prompts file (:func:`load_prompts_file`) that is malformed, empty, has ids outside the
  vocabulary, text without a tokenizer, or prompts too long for ``max_model_len``.

The parameter count is exact: the model is instantiated by transformers on the ``meta`` device
(no memory, no weights read).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import InputError

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8}
# config keys holding the routed expert count, by family
_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
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
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def _weight_names(path: Path) -> list[str]:
    files = sorted(path.glob("*.safetensors"))
    names: list[str] = []
    for f in files:
        try:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                if not 0 < n < 1 << 30:
                    raise ValueError(f"header length {n}")
                header = json.loads(fh.read(n))
        except (OSError, ValueError) as e:
            raise InputError(f"{f.name} is not a readable safetensors file ({e})",
                             source=str(path), field="weights") from None
        names += [k for k in header if k != "__metadata__"]
    if not files and not list(path.glob("pytorch_model*.bin")):
        raise InputError("no weight files (*.safetensors or pytorch_model*.bin): not a checkpoint",
                         source=str(path), field="weights")
    return names


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
    names = _weight_names(path)
    vocab = config.get("vocab_size")
    if vocab is None and isinstance(config.get("text_config"), dict):
        vocab = config["text_config"].get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 2:
        raise InputError(f"config.json: vocab_size must be an integer >= 2, got {vocab!r}",
                         source=src, field="vocab_size")
    experts = 0
    for k in _EXPERT_KEYS:
        v = config.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > experts:
            experts = v
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


def check_vllm_architecture(arch: str, engine_args: dict, src: str = "") -> None:
    """InputError unless vLLM's model registry has ``arch`` (or the Transformers backend is asked
    for), and every ``engine_args`` key is a vLLM engine argument."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.registry import ModelRegistry

    known_args = {f.name for f in dataclasses.fields(EngineArgs)}
    for k in engine_args:
        if k not in known_args:
            raise InputError(f"unknown vLLM engine argument {k!r}", field="engine-arg")
    if engine_args.get("model_impl") == "transformers":
        return
    if arch not in set(ModelRegistry.get_supported_archs()):
        import vllm

        raise InputError(f"architecture {arch!r} is not one vLLM {vllm.__version__} can run (not in "
                         "its model registry; --engine-arg model_impl=\"transformers\" tries vLLM's "
                         "Transformers backend)", source=src or None, field="architectures")


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


def available_memory_bytes() -> int:
    """``MemAvailable`` from /proc/meminfo (else total physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def dtype_bytes(dtype: str, src: str = "") -> int:
    d = str(dtype).replace("torch.", "")
    if d not in _DTYPE_BYTES:
        raise InputError(f"unsupported dtype {dtype!r} (expected one of {sorted(_DTYPE_BYTES)})",
                         source=src or None, field="dtype")
    return _DTYPE_BYTES[d]


def check_memory(info: CheckpointInfo, copies: dict[str, int], *,
                 available: int | None = None) -> int:
    """InputError if the copies of the weights the run will hold do not fit in RAM.

    ``copies``: ``{what: bytes per parameter}`` (e.g. ``{"engine bfloat16": 2, "trainer float32":
    4}``). Returns the estimate in bytes. The KV cache is not counted (vLLM CPU sizes it from
    ``gpu_memory_utilization``)."""
    if info.params is None:
        return 0
    need = info.params * sum(copies.values())
    avail = available_memory_bytes() if available is None else available
    if need > avail:
        parts = " + ".join(f"{what} {b} B" for what, b in copies.items())
        raise InputError(f"model will not fit in memory: {info.params:,} parameters x ({parts}) "
                         f"= {need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available",
                         source=str(info.path), field="memory")
    return need


def _load_tokenizer(info: CheckpointInfo):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(info.path), local_files_only=True)


def load_prompts_file(file: str | os.PathLike, info: CheckpointInfo, *, max_tokens: int,
                      max_model_len: int) -> list[list[int]]:
    """Prompts from a jsonl file, one per line: a list of token ids, ``{"prompt_token_ids": [...]}``,
    or (when the checkpoint has a tokenizer) a string / ``{"prompt": str}`` / ``{"text": str}``.
    Blank lines are skipped. Errors name the file, the line (1-based) and the index."""
    src = str(file)
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
    for ln, line in enumerate(text.splitlines(), start=1):
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
