"""``support_logprobs(..., temperature=T)`` against SkyRL 0.4.0's ``sample_support_scores``
(``skyrl/backends/skyrl_train/utils/sample_support_replay.py``): its LM-head path (hidden states,
``lm_head_weight``, ``temperature``: ``z = (h * W[id]).sum(-1) / T``) and its logits path (logits
already divided by T, as its trainer passes them), logprobs and entropies, on hypothesis-drawn
supports. Not bitwise: SkyRL computes ``(z_t - max) - log Σ exp(z - max)``, we ``z_t - (max + log
Σ)`` and sum in another order (33 to 43 of 64 logprobs came out bit-equal on a 64-token draw,
T = 0.7 ... 1.3); both lie within the float32 error bound of tests/support_tol.py around the
float64 spec, which is what is asserted.
"""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl_numerics.replay import PackedSupport, support_logprobs, support_logprobs_reference
from support_tol import float32_tolerance

SSR = "backends.skyrl_train.utils.sample_support_replay"


@st.composite
def cases(draw):
    n, H, V, K = draw(st.integers(1, 12)), draw(st.integers(1, 48)), draw(st.integers(2, 300)), draw(st.integers(1, 24))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    g = torch.Generator().manual_seed(int(rng.integers(2**31)))
    hidden = torch.randn(n, H, generator=g) * float(draw(st.sampled_from([0.3, 1.0, 4.0])))
    weight = torch.randn(V, H, generator=g) * 0.1
    sets = [np.sort(rng.choice(V, size=int(rng.integers(1, min(K, V) + 1)), replace=False)) for _ in range(n)]
    targets = torch.tensor([int(rng.choice(s)) for s in sets])
    T = draw(st.sampled_from([0.25, 0.6, 1.0, 1.3, 2.0]))
    return hidden, weight, targets, sets, T


def _support_ids(sets, K):
    ids = torch.full((len(sets), K), -1, dtype=torch.int32)
    for i, s in enumerate(sets):
        ids[i, : len(s)] = torch.as_tensor(s, dtype=torch.int32)
    return ids


@settings(max_examples=60, deadline=None)
@given(case=cases(), method=st.sampled_from(["dense", "sparse"]))
def test_support_logprobs_agree_with_sample_support_scores(skyrl, case, method):
    hidden, weight, targets, sets, T = case
    V = weight.shape[0]
    sup = PackedSupport.from_sets(sets, V)
    ids = _support_ids(sets, max(len(s) for s in sets))
    kw = dict(vocab_start_index=0, vocab_end_index=V, tp_group=None, compute_entropy=True)
    by_head = skyrl(SSR).sample_support_scores(hidden, targets, ids, lm_head_weight=weight, temperature=T, **kw)
    by_logits = skyrl(SSR).sample_support_scores((hidden @ weight.T) / T, targets, ids, **kw)
    lp, ent = support_logprobs(hidden, weight, targets, sup, method=method, temperature=T)
    rlp, rent = support_logprobs_reference(hidden.double(), weight.double(), targets, sup, temperature=T)
    tol = float32_tolerance(hidden, weight, sets, T)
    assert bool(by_head.valid_mask.all())
    for name, got_lp, got_ent in (("ours", lp, ent), ("skyrl lm-head", by_head.logprobs, by_head.entropy),
                                  ("skyrl logits", by_logits.logprobs, by_logits.entropy)):
        assert got_lp.dtype == torch.float32, name
        assert ((got_lp.double() - rlp).abs() <= tol).all(), name
        assert ((got_ent.double() - rent).abs() <= tol).all(), name
