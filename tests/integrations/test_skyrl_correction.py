"""``combine(..., order="skyrl_exact")`` bitwise against SkyRL 0.4.0's own
``compute_off_policy_correction`` (``skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py``)
on the same inputs, with the config built from the fields and defaults of its
``OffPolicyCorrectionConfig`` (read from ``skyrl/train/config/config.py`` with ``ast``: importing that
module pulls pandas). Compared: the keep mask against SkyRL's returned ``loss_mask``, and the
weights on kept tokens against its ``tis_ratio`` (bit patterns; 0 elsewhere, as our weights are).
Inputs are hypothesis-drawn: padded or flat (``cu_seqlens``) batches, ragged masks, rows with no
valid token, float32 / float64 / bfloat16, and log-ratios up to ±60 so the ±20 clamp is hit.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from skyrl_numerics import correction as C

OPC = "backends.skyrl_train.utils.off_policy_correction_utils"


@pytest.fixture(scope="module")
def skyrl_cfg(skyrl):
    """``cfg(**fields) -> DictConfig``: SkyRL's ``OffPolicyCorrectionConfig`` defaults, overridden."""
    from omegaconf import OmegaConf

    src = Path(skyrl("backends").__file__).parents[1] / "train" / "config" / "config.py"
    cls = next(n for n in ast.parse(src.read_text()).body
               if isinstance(n, ast.ClassDef) and n.name == "OffPolicyCorrectionConfig")
    defaults = {n.target.id: ast.literal_eval(n.value) for n in cls.body if isinstance(n, ast.AnnAssign)}
    assert "tis_ratio_type" in defaults and len(defaults) == 12, sorted(defaults)

    def cfg(**fields):
        assert set(fields) <= set(defaults), set(fields) - set(defaults)
        return OmegaConf.create({**defaults, **fields})
    return cfg


# our part -> (constructor options, SkyRL config fields)
TIS = [None, ("token_tis", {"cap": 2.0}, {"tis_ratio_type": "token", "token_tis_ratio_clip_high": 2.0}),
       ("token_tis", {"cap": 1.01}, {"tis_ratio_type": "token", "token_tis_ratio_clip_high": 1.01}),
       ("sequence_tis", {"cap": 5.0}, {"tis_ratio_type": "sequence", "sequence_tis_ratio_clip_high": 5.0})]
SEQ = [None, ("geometric_mask", {"lo": 0.99, "hi": 1.01}, {"sequence_mask_metric": "geometric",
                                                           "geo_mask_low": 0.99, "geo_mask_high": 1.01}),
       ("geometric_mask", {"lo": 0.5, "hi": 2.0}, {"sequence_mask_metric": "geometric", "geo_mask_low": 0.5,
                                                   "geo_mask_high": 2.0}),
       ("product_mask", {"lo": 1e-12, "hi": 1e12}, {"sequence_mask_metric": "product", "product_mask_low": 1e-12,
                                                    "product_mask_high": 1e12})]
VETO = [None, ("outlier_veto", {"lo": 1e-4}, {"outlier_token_is_threshold_low": 1e-4}),
        ("outlier_veto", {"lo": 1e-4, "hi": 100.0}, {"outlier_token_is_threshold_low": 1e-4,
                                                     "outlier_token_is_threshold_high": 100.0}),
        ("outlier_veto", {"lo": None, "hi": 100.0}, {"outlier_token_is_threshold_high": 100.0})]
TOKEN = [None, ("token_mask", {"lo": 0.5, "hi": 2.0}, {"token_mask_is_threshold_low": 0.5,
                                                       "token_mask_is_threshold_high": 2.0})]


@st.composite
def batches(draw):
    """Padded ``[B, T]`` trainer / rollout logprobs, a ragged 0/1 mask, and the lengths."""
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
    B, T = draw(st.integers(1, 6)), draw(st.integers(1, 40))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    rollout = -torch.rand(B, T, generator=g, dtype=torch.float64) * 8
    noise = draw(st.sampled_from([1e-3, 0.05, 1.0]))
    delta = torch.randn(B, T, generator=g, dtype=torch.float64) * noise
    if draw(st.booleans()):                                      # a few huge log-ratios: the ±20 clamp
        delta.view(-1)[torch.randint(0, B * T, (3,), generator=g)] = torch.tensor([60.0, -45.0, 25.0], dtype=torch.float64)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    return (rollout + delta).to(dtype), rollout.to(dtype), mask, lengths


def _ours(parts, trainer, rollout, mask, lengths, flat, order):
    if flat:
        keep = mask.bool()
        a, b, cu = trainer[keep], rollout[keep], torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        made = [getattr(C, n)(a, b, cu_seqlens=cu, **o) for n, o, _ in parts]
    else:
        made = [getattr(C, n)(trainer, rollout, mask, **o) for n, o, _ in parts]
    out = C.combine(*made, order=order)
    if not flat:
        return out.weights, out.mask
    w, k = torch.zeros(mask.shape, dtype=out.weights.dtype), torch.zeros(mask.shape, dtype=torch.bool)
    w[mask.bool()], k[mask.bool()] = out.weights, out.mask
    return w, k


def _skyrl(skyrl, skyrl_cfg, parts, trainer, rollout, mask):
    fields = {k: v for _, _, f in parts for k, v in f.items()}
    tis, _, loss_mask = skyrl(OPC).compute_off_policy_correction(trainer, rollout, mask, skyrl_cfg(**fields))
    keep = loss_mask > 0
    w = torch.ones_like(trainer) if tis is None else tis.expand_as(trainer)
    return torch.where(keep, w.to(torch.float64), 0.0), keep


def _bits(t):
    return t.view(torch.int64) if t.dtype == torch.float64 else t.view(torch.int32)


@pytest.mark.filterwarnings("ignore:std\\(\\)")        # SkyRL's is_ratio_std metric of a single token
@settings(max_examples=150, deadline=None)
@given(data=batches(), tis=st.sampled_from(TIS), seq=st.sampled_from(SEQ), veto=st.sampled_from(VETO),
       tok=st.sampled_from(TOKEN), flat=st.booleans())
def test_skyrl_exact_equals_compute_off_policy_correction(skyrl, skyrl_cfg, data, tis, seq, veto, tok, flat):
    parts = [p for p in (tis, seq, veto, tok) if p is not None]
    assume(parts)
    trainer, rollout, mask, lengths = data
    if flat:                       # SkyRL gets the padded batch a flat one stands for: T = the longest
        assume(int(lengths.max()) > 0)
        t = int(lengths.max())
        trainer, rollout, mask = trainer[:, :t], rollout[:, :t], mask[:, :t]
    w, keep = _ours(parts, trainer, rollout, mask, lengths, flat, "skyrl_exact")
    ref_w, ref_keep = _skyrl(skyrl, skyrl_cfg, parts, trainer, rollout, mask)
    assert torch.equal(keep, ref_keep)
    want = ref_w.to(w.dtype)                                 # bf16 / float32 values are exact in float32
    assert torch.equal(want.double(), ref_w)
    assert torch.equal(_bits(w), _bits(want)), f"{int((_bits(w) != _bits(want)).sum())} weights differ"


def test_the_other_orders_differ_from_skyrl_and_skyrl_exact_does_not(skyrl, skyrl_cfg):
    """The counts docs/gap.md quotes, on 64 x 512 float32 tokens with log-ratios N(0, 0.05) and one
    sequence whose Σ d is -51.2 (SkyRL's sequence ratio stops at e^-20 there)."""
    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(64, 512, generator=g) * 8
    trainer = rollout + torch.randn(64, 512, generator=g) * 0.05
    trainer[0] = rollout[0] - 0.1
    mask = torch.ones(64, 512)
    counts = {}
    for parts in ([TIS[3], SEQ[2]], [TIS[1], VETO[2]]):
        ref_w, ref_keep = _skyrl(skyrl, skyrl_cfg, parts, trainer, rollout, mask)
        for order in ("skyrl", "skyrl_exact"):
            w, keep = _ours(parts, trainer, rollout, mask, None, False, order)
            counts[f"{parts[0][0]}+{parts[1][0]}/{order}"] = int(((_bits(w.double()) != _bits(ref_w))
                                                                  | (keep != ref_keep)).sum())
    assert counts == {"sequence_tis+geometric_mask/skyrl": 12_800, "sequence_tis+geometric_mask/skyrl_exact": 0,
                      "token_tis+outlier_veto/skyrl": 355, "token_tis+outlier_veto/skyrl_exact": 0}, counts
