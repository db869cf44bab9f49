"""Child process of ``test_trl_grpo.py`` (TRL imports accelerate, datasets and pandas; see
``conftest.py``): TRL 1.16's own ``GRPOTrainer`` on the tiny Qwen3-MoE under
``batch_invariant_mode(strict=True)`` with and without ``integrations.trl.add_position_ids``.

A batch of 4 as TRL builds it: prompts of 3, 6, 2, 5 tokens **left**-padded, completions of 7, 4,
6, 3 tokens right-padded. For each configuration (fp32 / TRL's bf16 autocast, gradient
checkpointing off / on, ``torch.compile``d model):

* ``logps``: TRL's ``_get_per_token_logps_and_entropies`` on the batch in micro-batches of 4, 2
  and 1 (its ``batch_size``), and on each sequence alone without padding; the number of
  (split, sequence) pairs whose completion logprobs are not the bits of the sequence alone.
* ``grads``: TRL's ``_compute_loss`` (its default "dapo" loss: Σ per-token loss / the generation
  batch's token count ``num_items_in_batch``, which every micro-batch of that batch carries; fused
  LM head) + ``backward`` on the batch, on micro-batches of 2 and on each sequence alone (all with
  the whole batch's ``num_items_in_batch``, as TRL's split gives them); the gradient of the loss
  with respect to each sequence's input embeddings (the embedding layer's output, its real
  tokens); the number of (split, sequence) pairs not bitwise equal to the sequence alone.

The MoE load-balancing loss is off (``router_aux_loss_coef=0``) but in ``fp32_router_aux_loss``:
TRL adds it for any MoE config, and it is a statistic of the whole micro-batch's routing, so a
sequence's gradient depends on its neighbours by definition (not a rounding effect).

Prints one JSON line ``{name: {"logps_differing", "grads_differing", "checked", ...}}``.
"""
from __future__ import annotations

import json
import sys
import tempfile
import warnings

import torch

warnings.simplefilter("ignore")

from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from skyrl_numerics.integrations.trl import add_position_ids  # noqa: E402
from skyrl_numerics.kernels import batch_invariant_mode  # noqa: E402
from skyrl_numerics.models import build_tiny_model, load_hf_model  # noqa: E402

PROMPT_LENS, COMPLETION_LENS = [3, 6, 2, 5], [7, 4, 6, 3]
P, C = max(PROMPT_LENS), max(COMPLETION_LENS)


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"t{i}": i for i in range(512)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t2", unk_token="t1")


def _reward(completions, **kw):
    """A reward that varies, so GRPO's advantages are not all 0."""
    return [float(len(c)) for c in completions]


def make_trainer(out_dir: str, *, bf16: bool = False, gc: bool = False, compile: bool = False,
                 aux: bool = False, cls=GRPOTrainer, rollout_func=None, max_completion_length: int = C,
                 **config) -> GRPOTrainer:
    """``aux``: keep the model's MoE load-balancing loss (TRL adds ``router_aux_loss_coef`` = the
    config's 0.001 times it to the loss); off, ``router_aux_loss_coef=0``. ``config``: more
    ``GRPOConfig`` fields (``beta``, ...)."""
    model = load_hf_model(build_tiny_model("qwen3_moe"), dtype="float32").train()
    args = GRPOConfig(output_dir=out_dir, use_cpu=True, bf16=bf16, gradient_checkpointing=gc,
                      torch_compile=compile, router_aux_loss_coef=None if aux else 0.0, report_to="none", per_device_train_batch_size=4,
                      num_generations=2, max_completion_length=max_completion_length, logging_steps=1, save_strategy="no",
                      **config)
    data = Dataset.from_dict({"prompt": ["t5 t6 t7"] * 4})
    trainer = cls(model=model, reward_funcs=_reward, args=args, train_dataset=data,
                  processing_class=_tokenizer(), rollout_func=rollout_func)
    trainer.current_gradient_accumulation_steps = 1      # (set by Trainer's loop, which is not run)
    return trainer


def batch() -> dict:
    """TRL's layout: prompts left-padded, completions right-padded (pad id 0)."""
    g = torch.Generator().manual_seed(0)
    pm = torch.stack([(torch.arange(P) >= P - n).long() for n in PROMPT_LENS])
    cm = torch.stack([(torch.arange(C) < n).long() for n in COMPLETION_LENS])
    return {"prompt_ids": torch.randint(3, 500, (4, P), generator=g) * pm, "prompt_mask": pm,
            "completion_ids": torch.randint(3, 500, (4, C), generator=g) * cm, "completion_mask": cm,
            "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5]), "num_items_in_batch": cm.sum()}


def alone(inputs: dict, i: int) -> dict:
    """Sequence i without any padding."""
    p, c = PROMPT_LENS[i], COMPLETION_LENS[i]
    out = {"prompt_ids": inputs["prompt_ids"][i:i + 1, P - p:], "prompt_mask": inputs["prompt_mask"][i:i + 1, P - p:],
           "completion_ids": inputs["completion_ids"][i:i + 1, :c],
           "completion_mask": inputs["completion_mask"][i:i + 1, :c], "advantages": inputs["advantages"][i:i + 1]}
    out["num_items_in_batch"] = inputs["num_items_in_batch"]
    return out


def rows(inputs: dict, lo: int, hi: int) -> dict:
    out = {k: v[lo:hi] for k, v in inputs.items() if k != "num_items_in_batch"}
    out["num_items_in_batch"] = inputs["num_items_in_batch"]
    return out


def logps(trainer, model, inputs: dict, batch_size: int) -> torch.Tensor:
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        lp, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, inputs["completion_ids"].size(1),
                                                              batch_size=batch_size)
    return lp


def embedding_grads(trainer, model, inputs: dict) -> torch.Tensor:
    """d loss / d (input embeddings) of TRL's ``_compute_loss`` on ``inputs``, ``[B, P+C, H]``."""
    seen = []

    def keep(module, args, out):
        out.retain_grad()
        seen.append(out)
    h = trainer.model.get_input_embeddings().register_forward_hook(keep)
    try:
        trainer.model.zero_grad(set_to_none=True)
        trainer._compute_loss(model, inputs).backward()
    finally:
        h.remove()
    assert len(seen) == 1, f"{len(seen)} embedding calls"
    return seen[0].grad


def check(trainer, model) -> dict:
    inputs = batch()
    solo_lp = [logps(trainer, model, alone(inputs, i), 1)[0] for i in range(4)]
    solo_g = [embedding_grads(trainer, model, alone(inputs, i))[0] for i in range(4)]
    lp_bad = checked = 0
    for bs in (4, 2, 1):
        lp = logps(trainer, model, inputs, bs)
        for i, c in enumerate(COMPLETION_LENS):
            lp_bad += int(not torch.equal(lp[i, :c], solo_lp[i]))
            checked += 1
    g_bad = 0
    for lo, hi in ((0, 4), (0, 2), (2, 4)):
        g = embedding_grads(trainer, model, rows(inputs, lo, hi))
        for i in range(lo, hi):
            p, c = PROMPT_LENS[i], COMPLETION_LENS[i]
            g_bad += int(not torch.equal(g[i - lo, P - p:P + c], solo_g[i]))
    finite = all(bool(torch.isfinite(g).all()) and float(g.abs().sum()) > 0 for g in solo_g)
    return {"logps_differing": lp_bad, "grads_differing": g_bad, "checked": checked, "grads_checked": 8,
            "finite_nonzero": finite}


CONFIGS = {  # name -> (trainer options, shim)
    "fp32": ({}, True),
    "fp32_checkpointing": ({"gc": True}, True),
    "bf16_autocast": ({"bf16": True}, True),
    "bf16_autocast_checkpointing": ({"bf16": True, "gc": True}, True),
    "fp32_compiled": ({"compile": True}, True),
    "fp32_no_shim": ({}, False),
    "fp32_router_aux_loss": ({"aux": True}, True),
}


def main() -> None:
    out = {}
    names = sys.argv[1:] or list(CONFIGS)
    with tempfile.TemporaryDirectory() as d:
        for name in names:
            opts, shim = CONFIGS[name]
            trainer = make_trainer(d, **opts)
            model = trainer.model
            if opts.get("compile"):
                model = trainer.accelerator.prepare_model(trainer.model)   # what Trainer.train does
                out.setdefault("compiled_type", type(model).__name__)
            if opts.get("gc"):     # as Trainer.__init__/train enables it
                trainer.model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs)
                out.setdefault("checkpointing_on", {})[name] = bool(trainer.model.is_gradient_checkpointing)
            if shim:
                add_position_ids(trainer.model)
            with batch_invariant_mode(strict=True):
                out[name] = check(trainer, model)
    print(json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
