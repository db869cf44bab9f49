"""Child process of ``test_trl_correction.py``: TRL 1.16's own vLLM importance sampling
(``GRPOTrainer._generate_and_score_completions``, every ``vllm_importance_sampling_mode``) against
``integrations.trl.trl_importance_sampling``, and the ``apply_to_batch`` subclass recipe in TRL's
own ``_compute_loss``.

No vLLM engine runs here: TRL's ``rollout_func`` (its hook for external generation) returns fixed
completions of 3 to 48 tokens (179 in all) after prompts of 1 to 7 tokens with "sampling"
logprobs ``old − δ`` (``old``: TRL's own recomputed logprobs of the same tokens, from a first call;
δ ~ N(0, 0.15²) with one token in 8 at N(0, 1.5²), so ratios fall on both sides of every bound), and ``trainer.use_vllm`` is set after construction,
the one thing TRL reads to take its IS branch (constructing with ``use_vllm=True`` would start or
connect to a vLLM instance). Everything between is TRL's code.

Prints one JSON line: per mode/bounds case the valid tokens, how many of TRL's ratios our weights
equal bit for bit (``order="trl"``), how many the float64 path (``order="verl"``) equals, the largest
ulp distance of the latter, and how many tokens TRL clipped or zeroed; then the recipe checks.
"""
from __future__ import annotations

import json
import math
import sys
import tempfile
import warnings

import torch

warnings.simplefilter("ignore")

import trl_grpo_shim_child as base  # noqa: E402  (same folder: the trainer and the tokenizer)
from skyrl_numerics import correction as C  # noqa: E402
from skyrl_numerics.integrations.trl import apply_to_batch, trl_importance_sampling  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

PROMPT_LENS, COMPLETION_LENS = [3, 6, 2, 5, 4, 7, 1, 3], [40, 4, 33, 3, 17, 25, 9, 48]
CASES = [("token_truncate", None, 3.0), ("token_truncate", 0.5, 2.0),
         ("sequence_truncate", None, 3.0), ("sequence_truncate", 0.5, 2.0),
         ("token_mask", None, 3.0), ("token_mask", 0.5, 2.0), ("token_mask", 0.5, None),
         ("sequence_mask", None, 3.0), ("sequence_mask", 0.5, 2.0), ("sequence_mask", 0.5, None)]


class Rollouts:
    """``rollout_func``: fixed token ids; logprobs set by the test (``lps``)."""

    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in PROMPT_LENS]
        self.completions = [torch.randint(3, 500, (n,), generator=g).tolist() for n in COMPLETION_LENS]
        self.lps = [[-1.0] * n for n in COMPLETION_LENS]

    def __call__(self, prompts, trainer):
        return {"prompt_ids": self.prompts, "completion_ids": self.completions, "logprobs": self.lps}


class CorrectedGRPOTrainer(GRPOTrainer):
    """The recipe of docs/integrations.md: our correction in place of TRL's IS ratio."""

    make = None

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        if self.make is not None:
            done = apply_to_batch(self, batch, self.make)
            for k, v in done.metrics.items():
                self._metrics["train" if self.model.training else "eval"][k].append(v)
        return batch


def trainer(out_dir: str, rollouts) -> CorrectedGRPOTrainer:
    t = base.make_trainer(out_dir, cls=CorrectedGRPOTrainer, rollout_func=rollouts,
                          max_completion_length=max(COMPLETION_LENS))
    t.use_vllm, t.vllm_importance_sampling_correction = True, True
    t._last_loaded_step = t.state.global_step       # (no vLLM weights to sync)
    return t


def generate(t, mode, lo, hi) -> dict:
    t.vllm_importance_sampling_mode = mode
    t.vllm_importance_sampling_clip_min, t.vllm_importance_sampling_clip_max = lo, hi
    return t._generate_and_score_completions([{"prompt": "t5 t6 t7"}] * len(PROMPT_LENS))


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.float().view(torch.int32).long()


def compare(out: dict, mode, lo, hi) -> dict:
    a, b = out["old_per_token_logps"], out["sampling_per_token_logps"]
    m = out["completion_mask"]
    valid = m.bool()
    theirs = out["importance_sampling_ratio"].expand_as(a)[valid]
    ours = trl_importance_sampling(a, b, m, mode=mode, clip_min=lo, clip_max=hi)
    assert torch.equal(ours.mask, valid)
    w = ours.weights[valid]
    raw = torch.exp((a - b) if mode.startswith("token") else ((a - b) * m).sum(-1, keepdim=True).expand_as(a))[valid]
    f64 = C.combine(*_parts(a, b, m, mode, lo, hi), order="verl", denominator="valid").weights[valid]
    return {"valid": int(valid.sum()), "equal": int((bits(w) == bits(theirs)).sum()),
            "float64_equal": int((bits(f64) == bits(theirs)).sum()),
            "float64_max_ulp": int((bits(f64) - bits(theirs)).abs().max()),
            "touched": int((theirs != raw).sum())}


def _parts(a, b, m, mode, lo, hi):
    top, low = (math.inf if hi is None else hi), (0.0 if lo is None else lo)
    return {"token_truncate": lambda: [C.token_tis(a, b, m, cap=top, floor=lo)],
            "sequence_truncate": lambda: [C.sequence_tis(a, b, m, cap=top, floor=lo)],
            "token_mask": lambda: [C.masked_is(a, b, m, lo=low, hi=top, cap=math.inf)],
            "sequence_mask": lambda: [C.sequence_tis(a, b, m, cap=math.inf), C.product_mask(a, b, m, lo=low, hi=top)],
            }[mode]()


def recipe(t, rollouts) -> dict:
    """The subclass recipe: TRL's own mode through ``apply_to_batch`` gives TRL's loss bits; our
    ``masked_is`` drops rejected tokens from the "dapo" denominator."""
    t.make = None
    own = generate(t, "token_mask", 0.5, 2.0)
    loss_own = t._compute_loss(t.model, own)
    t.make = lambda a, b, m: trl_importance_sampling(a, b, m, mode="token_mask", clip_min=0.5, clip_max=2.0)
    via = generate(t, "token_mask", 0.5, 2.0)
    loss_via = t._compute_loss(t.model, via)
    t.make = lambda a, b, m: C.masked_is(a, b, m, lo=0.5, hi=2.0)
    ours = generate(t, "token_mask", 0.5, 2.0)
    loss_ours = t._compute_loss(t.model, ours)
    keep = ours["tool_mask"].bool() & ours["completion_mask"].bool()
    valid = own["completion_mask"].bool()
    w = ours["importance_sampling_ratio"]
    adv = ours["advantages"][:, None].expand_as(w)
    expected = float((-adv * w * keep).sum().double() / keep.sum())
    logged = t._metrics["train"]
    return {"trl_mode_loss_bits_equal": bool(torch.equal(bits(loss_own), bits(loss_via))),
            "trl_mode_ratio_bits_equal": bool(torch.equal(bits(own["importance_sampling_ratio"])[valid],
                                                          bits(via["importance_sampling_ratio"])[valid])),
            "kept": int(keep.sum()), "valid": int(ours["completion_mask"].sum()),
            "num_items_in_batch": int(ours["num_items_in_batch"]), "trl_num_items": int(own["num_items_in_batch"]),
            "loss_ours": float(loss_ours), "loss_expected": expected, "loss_own": float(loss_own),
            "advantages_nonzero": int((ours["advantages"] != 0).sum()),
            "logged_gap_mean_abs": logged.get("gap/mean_abs", [None])[-1],
            "logged_frac_tokens_masked": logged.get("correction/frac_tokens_masked", [None])[-1]}


def main() -> None:
    out = {"cases": {}}
    rollouts = Rollouts()
    with tempfile.TemporaryDirectory() as d:
        t = trainer(d, rollouts)
        first = generate(t, "token_truncate", None, 3.0)          # TRL's own logprobs of these tokens
        old = first["old_per_token_logps"]
        g = torch.Generator().manual_seed(2)
        wide = torch.rand(old.shape, generator=g) < 1 / 8
        delta = torch.randn(old.shape, generator=g) * torch.where(wide, 1.5, 0.15)
        rollouts.lps = [(old[i, :n] - delta[i, :n]).tolist() for i, n in enumerate(COMPLETION_LENS)]
        for mode, lo, hi in CASES:
            out["cases"][f"{mode}/{lo}/{hi}"] = compare(generate(t, mode, lo, hi), mode, lo, hi)
        out["recipe"] = recipe(t, rollouts)
    print(json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
