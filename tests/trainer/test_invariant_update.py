"""The invariant trainer's optimizer step (``InvariantTrainer._update``) against the textbook one
it replaced — ``p.grad = g.clone()``, ``torch.nn.utils.clip_grad_norm_``, AdamW, the masters
``.to(bf16)`` into the model — bit for bit, with the clip inactive, active, off, and a
non-finite gradient; ``last_grads`` are never written."""
from __future__ import annotations

import math

import pytest
import torch

from skyrl_numerics.models import build_tiny_model
from skyrl_numerics.trainer.config import TrainerConfig
from skyrl_numerics.trainer.invariant_trainer import InvariantTrainer


def _textbook_update(t: InvariantTrainer) -> float:
    for n, p in t.master.items():
        p.grad = t.last_grads[n].clone()
    gn = float(torch.nn.utils.clip_grad_norm_(list(t.master.values()),
                                              t.grad_clip if t.grad_clip else math.inf))
    t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for n, p in t.master.items():
            t.model.w(n).copy_(p.detach().to(t.model.dtype))
    return gn


def _grads(t: InvariantTrainer, seed: int, scale: float, poison: bool) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {n: torch.randn(p.shape, generator=g) * scale for n, p in t.master.items()}
    if poison:
        next(iter(out.values())).view(-1)[3] = float("inf")
    return out


@pytest.mark.parametrize("clip, scale, poison", [
    (1.0, 1e-4, False),      # norm under the clip: the factor clamps to 1
    (1e-3, 1.0, False),      # clipping active: scaled copies
    (None, 1.0, False),      # no clip
    (1.0, 1.0, True),        # an inf gradient: the factor is 0 (norm inf), as torch computes it
], ids=["under-clip", "clipped", "no-clip", "inf-grad"])
def test_update_is_the_textbook_step_bit_for_bit(clip, scale, poison):
    model = build_tiny_model("qwen3_moe")
    cfg = TrainerConfig(lr=1e-3, grad_clip=clip)
    ours, ref = InvariantTrainer(model, cfg), InvariantTrainer(model, cfg)
    for step in range(2):                        # the second step runs on AdamW's moments
        grads = _grads(ours, step, scale, poison and step == 0)
        ours.last_grads = {n: g.clone() for n, g in grads.items()}
        ref.last_grads = {n: g.clone() for n, g in grads.items()}
        gn, _ = ours._update()
        want = _textbook_update(ref)
        assert gn == want or (math.isnan(gn) and math.isnan(want))
        for n in ours.master:
            assert torch.equal(ours.last_grads[n], grads[n]), f"{n}: last_grads written"
            assert torch.equal(ours.master[n].view(torch.int32), ref.master[n].view(torch.int32)), n
            assert torch.equal(ours.model.w(n).view(torch.int16), ref.model.w(n).view(torch.int16)), n
