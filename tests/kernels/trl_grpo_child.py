"""Child process of ``test_mode_trace.py`` (TRL imports accelerate, datasets and pandas, which
would change what transformers finds in the test process; ``tests/integrations/conftest.py``):
TRL 1.16's own GRPO code on the tiny Qwen3-MoE under ``batch_invariant_mode(strict=True)``.

``GRPOTrainer._compute_loss`` — the per-token logprobs through TRL's fused LM head
(``ChunkedLogProbFunction``: ``mm.out`` tiles, an online logsumexp, a backward that accumulates
with ``acc.addmm_``), then the GRPO loss — forward and backward, in bf16 autocast (TRL's default
``bf16=True`` on CPU) and in fp32; then ``_get_per_token_logps_and_entropies`` of a right-padded
batch of 4 and of each sequence alone. Prints one JSON line: ``{"ok": true, ...}`` with the
number of sequences whose logprobs differ between the batch and the sequence alone, or
``{"ok": false, "op": ..., "error": ...}`` when the strict mode named an op.
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

from skyrl_numerics.errors import NotInvariant  # noqa: E402
from skyrl_numerics.kernels import batch_invariant_mode  # noqa: E402
from skyrl_numerics.models import build_tiny_model, load_hf_model  # noqa: E402

P, C = 5, 7                       # prompt and completion (right-padded) widths
COMPLETION_LENS = [7, 4, 6, 3]    # (prompts unpadded: a left-padded prompt moves its positions)


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"t{i}": i for i in range(512)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t2", unk_token="t1")


def _trainer(bf16: bool, out_dir: str) -> GRPOTrainer:
    model = load_hf_model(build_tiny_model("qwen3_moe"), dtype="float32").train()
    args = GRPOConfig(output_dir=out_dir, use_cpu=True, bf16=bf16, report_to="none",
                      per_device_train_batch_size=4, num_generations=2, max_completion_length=C,
                      logging_steps=1, save_strategy="no")
    data = Dataset.from_dict({"prompt": ["t5 t6 t7"] * 4})
    return GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                       args=args, train_dataset=data, processing_class=_tokenizer())


def _inputs() -> dict:
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 500, (4, P), generator=g)
    completion = torch.randint(3, 500, (4, C), generator=g)
    pm = torch.ones(4, P, dtype=torch.long)
    cm = torch.stack([(torch.arange(C) < n).long() for n in COMPLETION_LENS])
    return {"prompt_ids": prompt * pm, "prompt_mask": pm, "completion_ids": completion * cm,
            "completion_mask": cm, "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5]),
            "num_items_in_batch": cm.sum()}


def _rows_differing(trainer, inputs) -> int:
    """Sequences whose completion logprobs differ between the batch and the sequence alone (alone:
    no padding, so transformers drops the mask and takes SDPA's ``enable_gqa``; in the batch,
    ``repeat_kv`` with the padding mask)."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    lp, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)
    bad = 0
    for i, n in enumerate(COMPLETION_LENS):
        lp1, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids[i:i + 1, :P + n],
                                                               mask[i:i + 1, :P + n], n)
        bad += int(not torch.equal(lp[i, :n], lp1[0]))
    return bad


def run(bf16: bool, out_dir: str) -> dict:
    trainer = _trainer(bf16, out_dir)
    trainer.current_gradient_accumulation_steps = 1      # (set by Trainer's loop, which is not run)
    inputs = _inputs()
    with batch_invariant_mode(strict=True):
        loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        differing = _rows_differing(trainer, inputs)
    grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
    return {"loss": float(loss), "params_with_grad": len(grads),
            "finite": all(bool(torch.isfinite(g).all()) for g in grads), "rows_differing": differing}


def main() -> None:
    out = {"ok": True}
    try:
        with tempfile.TemporaryDirectory() as d:
            for name, bf16 in (("bf16_autocast", True), ("fp32", False)):
                out[name] = run(bf16, d)
    except NotInvariant as e:
        out = {"ok": False, "op": e.op, "error": str(e)}
    print(json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
