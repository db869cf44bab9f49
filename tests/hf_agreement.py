"""Trainer-side checks of an invariant family against HF transformers' own forward, shared by
tests/invariant: token ids, HF in float64 as the reference, the fp32 bound and packing / prefix
invariance.

fp32 bound: the same float32 weights through ours and through HF, both compared with HF in
float64: ``|ours - HF64| <= 4 · |HF32 - HF64| + 64 ulp(fp32) · scale`` (``scale`` the largest
|logit|): ours may order its sums differently from HF, not be less exact.
"""
from __future__ import annotations

import torch

F32_ULP = 2.0 ** -23


def token_ids(n: int, seed: int, vocab: int = 512) -> torch.Tensor:
    """``n`` token ids in ``[2, vocab)`` (0 and 1 are the tiny models' bos / eos)."""
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def hf_eager(model_dir, dtype=torch.float64):
    """HF's model in ``dtype`` (float64: the reference), its eager experts (HF's grouped-mm
    experts take no float64)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype,
                                                experts_implementation="eager").eval()


def fp32_errors(model_dir, ours_model, ids: torch.Tensor) -> tuple[float, float, float]:
    """``(|ours - HF64|, |HF32 - HF64|, scale)`` over the logits of one sequence, ``ours_model``
    the invariant model in float32 on ``model_dir``'s float32 weights."""
    from skyrl_numerics.models import load_hf_model

    with torch.no_grad():
        ours = ours_model.logits(ours_model.sequence_hidden(ids)).double()
        hf32 = load_hf_model(model_dir, dtype="float32")(ids[None]).logits[0].double()
        ref = hf_eager(model_dir)(ids[None]).logits[0]
    return (ours - ref).abs().max().item(), (hf32 - ref).abs().max().item(), ref.abs().max().item()


def assert_fp32_within_hfs_own_error(model_dir, ours_model, ids: torch.Tensor) -> None:
    ours_err, hf_err, scale = fp32_errors(model_dir, ours_model, ids)
    assert ours_err <= 4 * hf_err + 64 * F32_ULP * scale, (ours_err, hf_err, scale)


def assert_packing_and_prefix_invariant(model, lens: list[int], seed: int) -> None:
    """Sequences of ``lens`` packed into one forward get the bits each gets alone, and a
    prefix's rows are the whole sequence's first rows."""
    seqs = [token_ids(n, seed + j) for j, n in enumerate(lens)]
    with torch.no_grad():
        alone = [model.sequence_hidden(s) for s in seqs]
        packed = model.packed_hidden(seqs)
        pre = model.sequence_hidden(seqs[0][:max(1, lens[0] // 2)])
    assert torch.equal(packed, torch.cat(alone))
    assert torch.equal(alone[0][:pre.shape[0]], pre)
