"""The doctor's trainer copies: what each one holds, what scoring with it adds, and the order
that keeps one copy in memory at a time.

A *copy* is one model the rows' trainers load (:func:`trainer_key`): the HF model in a dtype,
optionally with QAT parametrizations (``(dtype, qat)``), or the family's invariant model
(``("invariant", kv_cache)``). Its bytes are counted, not guessed:

- **held** (:func:`trainer_copy_bytes`): ``Σ nbytes`` of the parameters and buffers of the very
  module the doctor loads, built on the ``meta`` device from the checkpoint's config (no weight
  is read; ~1 s at 1.3 B parameters), by dtype. HF keeps fp32 rotary buffers beside bf16
  weights; QAT parametrizations keep the original weight (same bytes) and compute the quantized
  one on each access.
- **load** (:func:`load_bytes`): an HF copy converted from the stored dtype holds the mapped
  stored tensors beside itself while it loads; the invariant model reads one tensor at a time.
- **work** (:func:`scoring_bytes`): what a scoring pass adds while the copy is held —
  ``LOGIT_COPIES`` ``[tokens, vocab]`` logit blocks (counted as fp32) of the largest batch (HF:
  ``trainer_logprobs``' 8 sequences, up to 1024 tokens a chunk; invariant: 4 sequences), and,
  under QAT, ``QAT_COPIES`` × the largest parametrized (3-D expert) weight, which each forward
  materializes (the stacked result and its per-expert parts).

:func:`scoring_order` runs the rows copy by copy (the copies in order of first use, the rows of
one copy in table order) and says after which row each copy is last needed, so the doctor frees
it there (:func:`release_copy`): the peak is the largest copy + its work, not their sum.
"""
from __future__ import annotations

import gc

GiB = 1 << 30
# logits in the model dtype and in fp32, the log-softmax, its exp and their product (entropy):
# 5 [tokens, vocab] blocks; measured at real dims (Qwen3-MoE, 8 x 80 tokens): 1.9 GiB of RSS
# over the held bf16 copy while scoring, 5 x 640 x 151,936 x 4 B = 1.81 GiB
LOGIT_COPIES = 5
QAT_COPIES = 2        # the stacked fake-quantized expert weight + its per-expert parts
# an HF copy converted from the stored dtype: measured at real dims (Qwen3-MoE, bf16 -> fp32)
# peak RSS 8.19 GiB over the process before it, for 4.71 GiB held and 2.36 GiB stored: 1.5x
# the stored bytes beside the copy (the mapped file + conversion buffers)
LOAD_CONVERT = 1.5
HF_BATCH, HF_CHUNK, INVARIANT_BATCH = 8, 1024, 4   # trainer_logprobs / invariant defaults
_TORCH_DTYPES = ("float32", "bfloat16", "float16", "float64")


def trainer_key(row, dtype: str | None = None) -> tuple:
    """The ``DoctorContext._models`` key of the trainer copy ``row`` loads (``compute.trainer``:
    ``("hf", dtype, qat)`` or ``("invariant", kv_cache[, plan scenario])``; rows without it load
    the HF model);
    ``dtype``: the trainer dtype of rows that keep the stored one (``DoctorContext.dtype``)."""
    t = getattr(row.compute, "trainer", None) or ("hf", None, None)
    if t[0] == "invariant":
        return t
    return (t[1] if t[1] is not None else dtype, t[2])


def copy_name(key: tuple) -> str:
    if key and key[0] == "invariant":   # ("invariant", kv_cache[, serving scenario of its plan])
        return ("invariant" + (f" (KV {key[1]})" if key[1] else "")
                + (f" + plan of {key[2]}" if len(key) > 2 else ""))
    qat = (key[1] if isinstance(key[1], (str, type(None))) else
           f"plan of {key[1][1]}" if isinstance(key[1], tuple) and key[1][:1] == ("plan",) else "spec")
    return f"HF {key[0] or 'stored dtype'}" + (f" + QAT {qat}" if key[1] is not None else "")


def _dtype_of(key: tuple, stored: str) -> str:
    d = key[0] if key[0] not in (None, "auto") else stored
    d = str(d).replace("torch.", "")
    if d not in _TORCH_DTYPES:
        from skyrl_numerics.errors import InputError

        raise InputError(f"trainer dtype {d!r} is not one of {list(_TORCH_DTYPES)}",
                         field="dtype")
    return d


_SIZES: dict = {}


def _meta_module(info, key: tuple):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(info.path))
    if key[0] == "invariant":
        from skyrl_numerics.invariant import architecture_of, family_class
        from skyrl_numerics.invariant.multimodal import text_config

        cfg = text_config(cfg)      # a multimodal checkpoint's language model
        cls = family_class(architecture_of(cfg))
        with torch.device("meta"):
            return cls.from_config(cfg, dtype=torch.bfloat16, kv_cache=key[1])
    dtype = getattr(torch, _dtype_of(key, info.stored_dtype))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def trainer_copy_bytes(info, key: tuple) -> dict[str, int]:
    """``{dtype: bytes}`` of the parameters and buffers the trainer copy ``key`` holds for the
    checkpoint ``info`` (a :class:`~skyrl_numerics.doctor.model_check.CheckpointInfo`): the module
    built on the meta device (module docstring). Cached per checkpoint and key."""
    ck = (str(info.path), info.config_hash, key)
    if ck not in _SIZES:
        mod = _meta_module(info, key)
        out: dict[str, int] = {}
        seen = set()
        for t in [*mod.parameters(), *mod.buffers()]:
            if id(t) in seen:   # tied weights count once
                continue
            seen.add(id(t))
            d = str(t.dtype).replace("torch.", "")
            out[d] = out.get(d, 0) + t.numel() * t.element_size()
        _SIZES[ck] = out
    return dict(_SIZES[ck])


def _largest_expert_weight(info, key: tuple) -> int:
    """Bytes of the largest 3-D (stacked experts) weight of the HF copy ``key``."""
    ck = (str(info.path), info.config_hash, key, "expert")
    if ck not in _SIZES:
        mod = _meta_module(info, (key[0], None))
        _SIZES[ck] = max((p.numel() * p.element_size() for p in mod.parameters()
                          if p.dim() == 3), default=0)
    return _SIZES[ck]


def scoring_bytes(info, key: tuple, *, n_prompts: int, seq_len: int) -> int:
    """Bytes a scoring pass with copy ``key`` adds beside the copy (module docstring)."""
    _check_ints(n_prompts=n_prompts, seq_len=seq_len)
    inv = key[0] == "invariant"
    tokens = min(HF_CHUNK, min(n_prompts, INVARIANT_BATCH if inv else HF_BATCH) * seq_len)
    work = LOGIT_COPIES * tokens * int(info.vocab_size) * 4
    if not inv and key[1] is not None:
        work += QAT_COPIES * _largest_expert_weight(info, key)
    return work


def load_bytes(info, key: tuple) -> int:
    """Bytes beside the held copy while it loads: an HF copy in a dtype other than the stored
    one maps the stored tensors and converts them (``LOAD_CONVERT`` × the stored bytes); one in
    the stored dtype, or the invariant model (read one tensor at a time), next to nothing
    (below its scoring work)."""
    if key[0] == "invariant" or _dtype_of(key, info.stored_dtype) == info.stored_dtype:
        return 0
    from .engine_memory import checkpoint_params

    return int(LOAD_CONVERT * checkpoint_params(info.path)[1])


def copy_need(info, key: tuple, *, n_prompts: int, seq_len: int) -> int:
    """What copy ``key`` needs while it loads and while its rows score: held bytes + the larger
    of its load and scoring transients."""
    return sum(trainer_copy_bytes(info, key).values()) + max(
        load_bytes(info, key), scoring_bytes(info, key, n_prompts=n_prompts, seq_len=seq_len))


def scoring_order(rows: list, dtype: str | None = None) -> tuple[list[int], dict[int, tuple]]:
    """``(order, frees)``: indices into ``rows`` grouped copy by copy (copies in order of first
    use, rows of a copy in table order), and ``{index: key}`` of the row after which copy
    ``key`` is needed no more."""
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(trainer_key(r, dtype), []).append(i)
    order = [i for idx in groups.values() for i in idx]
    return order, {idx[-1]: k for k, idx in groups.items()}


def release_copy(models: dict, key) -> bool:
    """Drop copy ``key`` from ``models`` (and what the rows cached next to it) and collect it
    now; True when it was loaded."""
    had = models.pop(key, None) is not None
    gc.collect()
    return had


def describe(sizes: dict[str, int]) -> str:
    total = sum(sizes.values())
    parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in sorted(sizes.items()))
    return f"{total / GiB:.2f} GiB ({parts})"


def _check_ints(**kw) -> None:
    for name, v in kw.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            from skyrl_numerics.errors import InputError

            raise InputError(f"{name} must be an integer >= 1, got {v!r}", field=name)
