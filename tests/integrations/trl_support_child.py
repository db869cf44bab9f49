"""Child process of ``test_trl_support.py``: sampler-support replay (``integrations.trl_support``)
inside TRL 1.16's own ``GRPOTrainer`` on the tiny Qwen3-MoE, with supports a real vLLM engine
captured (the parent's session engine ``vllm_qwen``, top-p 0.9 / top-k 64 at temperature 1; the
rollout file is ``argv[1]``).

TRL's ``rollout_func`` (its hook for external generation) returns the engine's prompts,
completions and processed logprobs; ``trainer.use_vllm`` is set after construction (as
``trl_correction_child.py``: constructing with ``use_vllm=True`` would start vLLM), so TRL's
``_generate_and_score_completions`` takes its vLLM importance-sampling branch. Everything runs
inside ``integrations.trl.invariant(trainer, strict=False)`` (the batch-invariant mode +
positions from the mask), so a sequence's bits do not depend on its batch, padding or micro-batch.

Prints one JSON line: the bitwise comparisons with our trainer's own support path
(``trainer_logprobs(use_support=True)``), the gap to the engine's logprobs with and without
replay, TRL's ``_compute_loss`` gradient against the support path's, the shuffle/split checks
through TRL's own ``shuffle_sequence_dict`` / ``split_tensor_dict``, and the error lines of bad
supports through ``_compute_loss``.
"""
from __future__ import annotations

import json
import sys
import tempfile
import warnings

import numpy as np
import torch

warnings.simplefilter("ignore")

import trl_grpo_shim_child as base  # noqa: E402  (same folder: the trainer and the tokenizer)
from skyrl_numerics.errors import InputError  # noqa: E402
from skyrl_numerics.integrations.trl import invariant  # noqa: E402
from skyrl_numerics.integrations.trl_support import (SUPPORT_KEY, SupportReplay, add_support,  # noqa: E402
                                                     packed_support, support_tensor)
from skyrl_numerics.replay import support_logprobs  # noqa: E402
from skyrl_numerics.rollout import Rollout  # noqa: E402
from skyrl_numerics.trainer.logprobs import decoder_and_head, trainer_logprobs  # noqa: E402
from trl import GRPOTrainer  # noqa: E402
from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict  # noqa: E402

ROLL = Rollout.load(sys.argv[1])
B = len(ROLL)
C = int(ROLL.response_lens.max())


class ReplayGRPOTrainer(SupportReplay, GRPOTrainer):
    """The recipe of docs/integrations.md; ``support`` set by the test."""

    support = None
    added = None

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        if self.support is not None:
            self.added = add_support(self, batch, self.support)
        return batch


def rollout_func(prompts, trainer):
    return {"prompt_ids": [ROLL.prompt(i).tolist() for i in range(B)],
            "completion_ids": [ROLL.response(i).tolist() for i in range(B)],
            "logprobs": [ROLL.logprobs(i).tolist() for i in range(B)]}


def padded(values: np.ndarray) -> torch.Tensor:
    """Per-token values of the rollout as ``[B, C]`` (0 after each response)."""
    out = torch.zeros(B, C, dtype=torch.float32)
    for i in range(B):
        a, b = ROLL.response_cu[i], ROLL.response_cu[i + 1]
        out[i, :b - a] = torch.from_numpy(values[a:b])
    return out


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.float().view(torch.int32)


def differing(a, b, valid) -> int:
    return int((bits(a) != bits(b))[valid].sum())


def full_mask() -> torch.Tensor:
    return (torch.arange(C)[None, :] < torch.from_numpy(ROLL.response_lens)[:, None]).long()


def inputs_of(batch):
    return (torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1))


def replayed(t, batch, support, batch_size=None):
    ids, mask = inputs_of(batch)
    t.active_support = support
    try:
        with torch.no_grad():
            return t._get_per_token_logps_and_entropies(t.model, ids, mask, ids.size(1) - batch["prompt_ids"].size(1),
                                                        batch_size=batch_size, compute_entropy=True)
    finally:
        t.active_support = None


def head_grad(t, batch) -> torch.Tensor:
    t.model.zero_grad(set_to_none=True)
    t._compute_loss(t.model, batch).backward()
    return t.model.get_output_embeddings().weight.grad.clone()


def expected_grad(t, batch, sup) -> torch.Tensor:
    """The LM head's gradient of TRL's loss at ratio 1 (old logprobs = the replayed ones) written
    on our support path: ``Σ -A_i w_it lp_it m_it / num_items`` with ``lp`` from
    ``support_logprobs`` on the backbone's hidden states (positions from the mask)."""
    body, weight = decoder_and_head(t.model)
    ids, mask = inputs_of(batch)
    t.model.zero_grad(set_to_none=True)
    h = body(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).masked_fill(mask == 0, 1),
             use_cache=False).last_hidden_state[:, -C - 1:-1]
    valid = batch["completion_mask"].bool()
    lp, _ = support_logprobs(h[valid], weight, batch["completion_ids"][valid], packed_support(sup, batch["completion_ids"],
                                                                                          batch["completion_mask"], weight.shape[0]))
    w = batch["importance_sampling_ratio"].expand(B, C)[valid]
    adv = batch["advantages"][:, None].expand(B, C)[valid]
    (-(adv * w * lp)).sum().div(batch["num_items_in_batch"]).backward()
    return weight.grad.clone()


def shuffle_split(t, batch, lp_all, seeds=range(6)) -> dict:
    """TRL's own shuffle + split of the batch (as ``_prepare_inputs``): every part's supports are
    its rows' and its replayed logprobs the bits of those rows in the whole batch."""
    rows_bad = lp_bad = parts_n = 0
    for seed in seeds:
        torch.manual_seed(seed)
        d = {**batch, "row": torch.arange(B)}
        for part in split_tensor_dict(shuffle_sequence_dict(d), 2):
            r = part["row"]
            rows_bad += int(not torch.equal(part[SUPPORT_KEY], batch[SUPPORT_KEY][r]))
            lp, _, _ = replayed(t, part, part[SUPPORT_KEY])
            lp_bad += differing(lp, lp_all[r], part["completion_mask"].bool())
            parts_n += 1
    return {"parts": parts_n, "support_rows_differing": rows_bad, "logps_differing": lp_bad}


def bad_supports(t, batch) -> dict:
    sup, out = batch[SUPPORT_KEY], {}
    valid = batch["completion_mask"].bool()
    b, j = [int(x) for x in valid.nonzero()[-1]]
    wrong_id = sup.clone()
    wrong_id[b, j, -1] = 10 ** 6
    own = sup.clone()
    own[b, j] = torch.where(sup[b, j] == batch["completion_ids"][b, j], -1, sup[b, j])
    for name, s in {"shape": sup[:, :-1], "out_of_vocab": wrong_id, "not_own_token": own}.items():
        try:
            t._compute_loss(t.model, {**batch, SUPPORT_KEY: s})
            out[name] = None
        except InputError as e:
            out[name] = str(e)
    out["last_valid"] = [b, j]
    return out


def ref_and_aux(d: str, prompts, sup) -> dict:
    """``beta != 0`` (TRL's KL term, a reference model) and the MoE aux loss on: ``add_support``
    replays the reference logprobs (the same weights here, so the policy's bits), and the
    replayed forward's aux loss is TRL's own."""
    t = base.make_trainer(d, cls=ReplayGRPOTrainer, rollout_func=rollout_func, max_completion_length=C,
                          aux=True, beta=0.04)
    t.use_vllm, t.vllm_importance_sampling_correction = True, True
    t._last_loaded_step = t.state.global_step
    with invariant(t, strict=False):
        t.support = sup
        batch = t._generate_and_score_completions(prompts)
        valid = batch["completion_mask"].bool()
        ids, mask = inputs_of(batch)
        with torch.no_grad():
            _, _, aux_trl = t._get_per_token_logps_and_entropies(t.model, ids, mask, C, compute_aux_loss=True)
            t.active_support = batch[SUPPORT_KEY]
            _, _, aux_rep = t._get_per_token_logps_and_entropies(t.model, ids, mask, C, compute_aux_loss=True)
            t.active_support = None
        loss = t._compute_loss(t.model, batch)
    return {"has_ref_model": t.ref_model is not None, "aux_enabled": bool(t.aux_loss_enabled),
            "ref_vs_old_differing": differing(batch["ref_per_token_logps"], batch["old_per_token_logps"], valid),
            "aux_trl": float(aux_trl), "aux_replayed": float(aux_rep),
            "aux_bitwise": bool(torch.equal(bits(aux_trl), bits(aux_rep))), "loss_finite": bool(torch.isfinite(loss))}


def main() -> None:
    out = {"tokens": int(ROLL.num_response_tokens), "support_sizes": [int(ROLL.support.sizes.min()),
                                                                       float(ROLL.support.sizes.mean()),
                                                                       int(ROLL.support.sizes.max())]}
    with tempfile.TemporaryDirectory() as d:
        t = base.make_trainer(d, cls=ReplayGRPOTrainer, rollout_func=rollout_func, max_completion_length=C)
        t.use_vllm, t.vllm_importance_sampling_correction = True, True
        t._last_loaded_step = t.state.global_step       # (no vLLM weights to sync)
        t.vllm_importance_sampling_mode = "token_truncate"
        prompts = [{"prompt": "t5 t6 t7"}] * B
        # strict=False: the whole of _generate_and_score_completions runs here (rewards, group
        # advantages, metrics), not only the logprob and loss path the strict tests cover
        with invariant(t, strict=False):
            stock = t._generate_and_score_completions(prompts)          # TRL alone: full vocabulary
            t.support = support_tensor(ROLL.support, full_mask())
            batch = t._generate_and_score_completions(prompts)          # + add_support
            valid = batch["completion_mask"].bool()
            ours = padded(trainer_logprobs(t.model, ROLL, use_support=True, batch_size=B).logprobs)
            lp_mixin, ent_mixin, _ = replayed(t, batch, batch[SUPPORT_KEY], batch_size=2)
            engine = batch["sampling_per_token_logps"]
            gap_full = (stock["old_per_token_logps"] - engine)[valid].abs()
            gap_rep = (batch["old_per_token_logps"] - engine)[valid].abs()
            out["logps"] = {"valid": int(valid.sum()),
                            "add_support_vs_ours_differing": differing(batch["old_per_token_logps"], ours, valid),
                            "mixin_vs_ours_differing": differing(lp_mixin, ours, valid),
                            "stock_vs_ours_differing": differing(stock["old_per_token_logps"], ours, valid),
                            "entropy_finite": bool(torch.isfinite(ent_mixin[valid]).all())}
            out["gap"] = {"full_vocab_mean": float(gap_full.mean()), "full_vocab_max": float(gap_full.max()),
                          "replayed_mean": float(gap_rep.mean()), "replayed_max": float(gap_rep.max()),
                          "ratio_dev_full": float((stock["importance_sampling_ratio"] - 1)[valid].abs().mean()),
                          "ratio_dev_replayed": float((batch["importance_sampling_ratio"] - 1)[valid].abs().mean()),
                          "logged": t.added.metrics}
            g_rep = head_grad(t, batch)
            g_stock = head_grad(t, {k: v for k, v in batch.items() if k != SUPPORT_KEY})
            g_exp = expected_grad(t, batch, batch[SUPPORT_KEY])
            scale = float(g_exp.abs().max())
            out["grad"] = {"max_abs_diff_vs_support_path": float((g_rep - g_exp).abs().max()) / scale,
                           "max_abs_diff_vs_stock": float((g_rep - g_stock).abs().max()) / scale,
                           "nonzero": bool(scale > 0)}
            lp_all, _, _ = replayed(t, batch, batch[SUPPORT_KEY])
            out["shuffle_split"] = shuffle_split(t, batch, lp_all)
            out["errors"] = bad_supports(t, batch)
        out["ref_and_aux"] = ref_and_aux(d, prompts, support_tensor(ROLL.support, full_mask()))
    print(json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
