"""correction: hand vectors per method, caps and masks, layouts, torch/numpy, errors."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl_numerics import correction as C
from skyrl_numerics import gap
from skyrl_numerics.errors import InputError

# rollout logprob 0 and trainer logprob ln r, so the ratio of every token is r exactly-ish:
#   seq 0: r = [3, 0.6, 1.5]   (Π = 2.7, geo-mean 2.7^(1/3) = 1.3925)
#   seq 1: r = [0.25, 1.2]     (Π = 0.3, geo-mean 0.3^(1/2) = 0.5477), then one padding slot
R = [[3.0, 0.6, 1.5], [0.25, 1.2, 1.0]]
TRAIN = torch.log(torch.tensor(R, dtype=torch.float64))
TRAIN[1, 2] = float("nan")                     # padding: never read
ROLL = torch.zeros(2, 3, dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
CU = torch.tensor([0, 3, 5])
KEEP_SEQ0 = [[1, 1, 1], [0, 0, 0]]


def _w(c):
    return np.asarray(c.weights, dtype=np.float64)


def _m(c):
    return np.asarray(c.mask).astype(int).tolist()


def test_token_tis_hand():
    c = C.token_tis(TRAIN, ROLL, MASK, cap=2.0)
    np.testing.assert_allclose(_w(c), [[2, 0.6, 1.5], [0.25, 1.2, 0]], rtol=1e-15)
    assert _m(c) == MASK.int().tolist()
    assert c.metrics["frac_tokens_clipped"] == 0.2                 # the 3
    assert c.metrics["mean_weight"] == pytest.approx(5.55 / 5, rel=1e-15, abs=0)
    assert c.metrics["mean_ratio"] == pytest.approx(6.55 / 5, rel=1e-15, abs=0)
    assert c.metrics["frac_tokens_masked"] == 0 and c.metrics["frac_seqs_masked"] == 0
    assert (c.metrics["n_tokens"], c.metrics["n_seqs"]) == (5, 2)


def test_sequence_tis_hand():
    c = C.sequence_tis(TRAIN, ROLL, MASK, cap=2.0)
    np.testing.assert_allclose(_w(c), [[2, 2, 2], [0.3, 0.3, 0]], rtol=1e-14)   # min(2.7, 2), 0.3
    assert c.metrics["frac_seqs_clipped"] == 0.5
    assert c.metrics["frac_tokens_clipped"] == 0.6
    assert c.metrics["mean_weight"] == pytest.approx(6.6 / 5, rel=1e-14, abs=0)
    big = C.sequence_tis(TRAIN, ROLL, MASK, cap=10.0)
    np.testing.assert_allclose(_w(big), [[2.7, 2.7, 2.7], [0.3, 0.3, 0]], rtol=1e-14)


def test_sequence_masks_hand():
    g = C.geometric_mask(TRAIN, ROLL, MASK, lo=0.6, hi=1.5)        # 1.3925 in, 0.5477 out
    assert _m(g) == KEEP_SEQ0
    assert g.metrics["frac_tokens_masked"] == 0.4 and g.metrics["frac_seqs_masked"] == 0.5
    np.testing.assert_array_equal(_w(g), [[1, 1, 1], [1, 1, 0]])
    assert _m(C.geometric_mask(TRAIN, ROLL, MASK, hi=1.4)) == [[1, 1, 1], [0, 0, 0]]  # lo = 1/1.4
    assert _m(C.geometric_mask(TRAIN, ROLL, MASK, hi=1.3)) == [[0, 0, 0], [0, 0, 0]]
    p = C.product_mask(TRAIN, ROLL, MASK, lo=0.5, hi=3.0)           # 2.7 in, 0.3 out
    assert _m(p) == KEEP_SEQ0
    assert _m(C.product_mask(TRAIN, ROLL, MASK)) == [[0, 0, 0], [0, 0, 0]]           # [0.5, 2]
    assert _m(C.product_mask(TRAIN, ROLL, MASK, lo=0.2, hi=2.8)) == MASK.int().tolist()


def test_outlier_veto_hand():
    v = C.outlier_veto(TRAIN, ROLL, MASK, lo=0.3)                  # 0.25 < 0.3 vetoes seq 1
    assert _m(v) == KEEP_SEQ0
    assert v.metrics["frac_tokens_outlier"] == 0.2 and v.metrics["frac_seqs_masked"] == 0.5
    both = C.outlier_veto(TRAIN, ROLL, MASK, lo=0.3, hi=2.5)       # 3 > 2.5 vetoes seq 0 too
    assert _m(both) == [[0, 0, 0], [0, 0, 0]] and both.metrics["mean_weight"] != both.metrics["mean_weight"]
    assert _m(C.outlier_veto(TRAIN, ROLL, MASK)) == MASK.int().tolist()               # lo = 1e-4


def test_token_mask_and_mis_hand():
    t = C.token_mask(TRAIN, ROLL, MASK, hi=2.0)                    # keep r in [0.5, 2]
    assert _m(t) == [[0, 1, 1], [0, 1, 0]]
    assert t.metrics["frac_tokens_masked"] == 0.4 and t.metrics["frac_seqs_masked"] == 0
    m = C.masked_is(TRAIN, ROLL, MASK, hi=2.0)
    assert _m(m) == [[0, 1, 1], [0, 1, 0]]
    np.testing.assert_allclose(_w(m), [[2, 0.6, 1.5], [0.25, 1.2, 0]], rtol=1e-15)  # C = hi
    np.testing.assert_allclose(np.asarray(m.loss_weights), [[0, 0.6, 1.5], [0, 1.2, 0]], rtol=1e-15)
    assert m.metrics["mean_weight"] == pytest.approx(3.3 / 3, rel=1e-15, abs=0)
    assert m.metrics["frac_tokens_clipped"] == 0
    capped = C.masked_is(TRAIN, ROLL, MASK, hi=2.0, cap=1.0)       # kept 1.5, 1.2 clipped to 1
    np.testing.assert_allclose(np.asarray(capped.loss_weights), [[0, 0.6, 1], [0, 1, 0]], rtol=1e-15)
    assert capped.metrics["frac_tokens_clipped"] == 0.4


def test_combine_hand():
    parts = (C.token_tis(TRAIN, ROLL, MASK, cap=2.0), C.geometric_mask(TRAIN, ROLL, MASK, lo=0.6, hi=1.5),
             C.outlier_veto(TRAIN, ROLL, MASK))
    for order in ("verl", "skyrl"):          # here the veto removes nothing: both orders agree
        c = C.combine(*parts, order=order)
        assert _m(c) == KEEP_SEQ0
        assert c.metrics["mean_weight"] == pytest.approx(4.1 / 3, rel=1e-15, abs=0)
        assert c.metrics["frac_tokens_masked"] == 0.4 and c.metrics["frac_seqs_masked"] == 0.5
        assert c.metrics["token_tis/frac_tokens_clipped"] == 0.2
    assert C.combine(*parts, order="verl").name == "token_tis+geometric_mask+outlier_veto"
    assert C.combine(*parts).name == "outlier_veto+token_tis+geometric_mask"      # skyrl: veto first
    np.testing.assert_allclose(_w(C.combine(*parts, order="verl")), [[2, 0.6, 1.5], [0.25, 1.2, 0]], rtol=1e-15)
    other = C.token_tis(TRAIN[:1], ROLL[:1], MASK[:1])
    with pytest.raises(InputError):
        C.combine(C.combine(*parts), other)
    with pytest.raises(InputError) as e:
        C.combine(*parts, order="megatron")
    assert e.value.field == "order"


def test_combine_orders_differ_hand():
    """token mask keep r in [0.5, 2] -> seq 0 keeps {0.6, 1.5}, seq 1 keeps {1.2}.

    skyrl: sequence TIS and the geometric mask see only the kept tokens:
      Π = 0.9 and 1.2; geo-means sqrt(0.9) = 0.949 and 1.2, both inside [0.6, 1.5].
    verl: both see the original mask: Π = 2.7 and 0.3; geo-means 1.39 (in) and 0.548 (out).
    """
    parts = (C.sequence_tis(TRAIN, ROLL, MASK, cap=10.0), C.geometric_mask(TRAIN, ROLL, MASK, lo=0.6, hi=1.5),
             C.token_mask(TRAIN, ROLL, MASK, hi=2.0))
    sky = C.combine(*parts, order="skyrl")
    assert sky.name == "token_mask+sequence_tis+geometric_mask"
    assert _m(sky) == [[0, 1, 1], [0, 1, 0]]
    np.testing.assert_allclose(_w(sky), [[0, 0.9, 0.9], [0, 1.2, 0]], rtol=1e-14)
    assert sky.metrics["mean_weight"] == pytest.approx(3.0 / 3, rel=1e-14, abs=0)
    assert sky.metrics["sequence_tis/n_tokens"] == 3.0          # the part saw the 3 kept tokens
    verl = C.combine(*parts, order="verl")
    assert _m(verl) == [[0, 1, 1], [0, 0, 0]]
    np.testing.assert_allclose(_w(verl), [[2.7, 2.7, 2.7], [0.3, 0.3, 0]], rtol=1e-14)
    assert verl.metrics["mean_weight"] == pytest.approx(2.7, rel=1e-14, abs=0)
    assert verl.metrics["sequence_tis/n_tokens"] == 5.0

    # product mask [0.5, 2] after the token mask: 0.9 and 1.2 pass (skyrl); 2.7 and 0.3 fail (verl)
    pm = (C.token_tis(TRAIN, ROLL, MASK, cap=2.0), C.product_mask(TRAIN, ROLL, MASK),
          C.token_mask(TRAIN, ROLL, MASK, hi=2.0))
    assert _m(C.combine(*pm, order="skyrl")) == [[0, 1, 1], [0, 1, 0]]
    np.testing.assert_allclose(np.asarray(C.combine(*pm, order="skyrl").loss_weights),
                               [[0, 0.6, 1.5], [0, 1.2, 0]], rtol=1e-15)
    assert _m(C.combine(*pm, order="verl")) == [[0, 0, 0], [0, 0, 0]]

    # veto first (skyrl): seq 1 vetoed (0.25 < 0.3) before the sequence TIS, whose metric then
    # counts 1 of 1 remaining sequences clipped (2.7 > 2); verl counts 1 of 2
    vt = (C.sequence_tis(TRAIN, ROLL, MASK, cap=2.0), C.outlier_veto(TRAIN, ROLL, MASK, lo=0.3))
    assert C.combine(*vt, order="skyrl").metrics["sequence_tis/frac_seqs_clipped"] == 1.0
    assert C.combine(*vt, order="verl").metrics["sequence_tis/frac_seqs_clipped"] == 0.5
    for order in ("skyrl", "verl"):
        assert _m(C.combine(*vt, order=order)) == KEEP_SEQ0


def test_combine_skyrl_exact_hand():
    """SkyRL's arithmetic: the hand pipeline of test_combine_orders_differ_hand gives the same
    masks and, within float32, the same weights; the NaN in the padding is never read."""
    parts = (C.sequence_tis(TRAIN, ROLL, MASK, cap=10.0), C.geometric_mask(TRAIN, ROLL, MASK, lo=0.6, hi=1.5),
             C.token_mask(TRAIN, ROLL, MASK, hi=2.0))
    ex = C.combine(*parts, order="skyrl_exact")
    assert ex.name == "token_mask+sequence_tis+geometric_mask"
    assert _m(ex) == [[0, 1, 1], [0, 1, 0]]
    # SkyRL's ratios go through float32 even for float64 input (safe_exp_delta): 2 float32 ulp
    np.testing.assert_allclose(_w(ex), [[0, 0.9, 0.9], [0, 1.2, 0]], rtol=2.0 ** -22)
    assert ex.weights.dtype == torch.float64 and "sequence_tis/n_tokens" not in ex.metrics
    f32 = C.combine(*(C.token_tis(TRAIN.float(), ROLL.float(), MASK, cap=1.1),), order="skyrl_exact")
    assert f32.weights.dtype == torch.float32
    assert f32.weights[0, 0] == torch.tensor(1.1, dtype=torch.float32)
    assert float(f32.weights[0, 0]) > 1.1                        # fp32(C), as SkyRL's clamp gives


def test_combine_skyrl_exact_clamps_log_ratios_at_20():
    """A sequence with Σ d = -30 (3 tokens of -10): sequence TIS is e^-20 in SkyRL's arithmetic,
    e^-30 in the others; a token ratio e^25 vetoed above 1e10 by the others but not by SkyRL (its
    ratio stops at e^20 = 4.85e8). Flat input and numpy input give the same."""
    trainer = torch.tensor([[-10.0, -10.0, -10.0], [25.0, 0.0, 0.0]])
    roll = torch.zeros(2, 3)
    seq = C.sequence_tis(trainer, roll, cap=5.0)
    assert float(C.combine(seq, order="skyrl").weights[0, 0]) == pytest.approx(math.exp(-30), rel=1e-6)
    ex = C.combine(seq, order="skyrl_exact")
    assert ex.weights[0, 0] == torch.tensor(-20.0).exp()
    veto = C.outlier_veto(trainer, roll, lo=None, hi=1e10)
    assert _m(C.combine(veto, order="skyrl"))[1] == [0, 0, 0]
    assert _m(C.combine(veto, order="skyrl_exact"))[1] == [1, 1, 1]
    flat = C.combine(C.sequence_tis(trainer.reshape(-1), roll.reshape(-1), cu_seqlens=torch.tensor([0, 3, 6]),
                                    cap=5.0), order="skyrl_exact")
    assert torch.equal(flat.weights, ex.weights.reshape(-1))
    npy = C.combine(C.sequence_tis(trainer.numpy(), roll.numpy(), cap=5.0), order="skyrl_exact")
    assert npy.weights.dtype == np.float64 and np.array_equal(npy.weights, ex.weights.double().numpy())


@pytest.mark.parametrize("cap", [3.0, 2.0, 1.1, 5.0, 7.0, 0.3])
def test_clipped_weights_are_exactly_the_cap(cap):
    """exp(min(d, ln C)) is not C in float64 (C = 3 gives 3.0000000000000004): the weight must be C."""
    tr = torch.tensor([[10.0, math.log(cap), math.log(cap) + 1e-15, -1.0]], dtype=torch.float64)
    roll = torch.zeros_like(tr)
    for c in (C.token_tis(tr, roll, cap=cap), C.masked_is(tr, roll, hi=100.0, cap=cap),
              C.sequence_tis(tr, roll, cap=cap)):
        w = np.asarray(c.weights)
        assert w.max() == cap, (c.name, w.max())
        assert (w <= cap).all()
    assert np.asarray(C.token_tis(tr, roll, cap=cap).weights)[0, 0] == cap
    for dt in (torch.float32, torch.bfloat16):                  # float32 out: never rounded above C
        w32 = C.token_tis(tr.to(dt), roll.to(dt), cap=cap).weights
        assert w32.dtype == torch.float32 and (w32.double() <= cap).all()
        np.testing.assert_allclose(w32[0, 0].item(), cap, rtol=2 ** -23)


ALL = [lambda *a, **k: C.token_tis(*a, **k), C.sequence_tis, C.geometric_mask, C.product_mask,
       C.outlier_veto, C.token_mask, C.masked_is]


@pytest.mark.parametrize("fn", ALL)
def test_flat_layout_equals_padded(fn):
    flat_t, flat_r = TRAIN[MASK], ROLL[MASK]
    padded = fn(TRAIN, ROLL, MASK)
    flat = fn(flat_t, flat_r, cu_seqlens=CU)
    torch.testing.assert_close(flat.weights, padded.weights[MASK], rtol=0, atol=0)
    assert torch.equal(flat.mask, padded.mask[MASK])
    assert flat.metrics == padded.metrics
    np_flat = fn(flat_t.numpy(), flat_r.numpy(), cu_seqlens=CU.numpy())
    assert isinstance(np_flat.weights, np.ndarray) and np_flat.weights.dtype == np.float64
    np.testing.assert_array_equal(np_flat.weights, flat.weights.numpy())
    # a flat 1-D mask over a longer stream
    big_t = torch.cat([flat_t, torch.tensor([float("nan")])])
    big_r = torch.cat([flat_r, torch.tensor([0.0], dtype=torch.float64)])
    m = torch.tensor([1, 1, 1, 1, 1, 0], dtype=torch.bool)
    masked = fn(big_t, big_r, m, cu_seqlens=torch.tensor([0, 3, 6]))
    torch.testing.assert_close(masked.weights[:5], flat.weights, rtol=0, atol=0)
    assert masked.weights[5] == 0 and not masked.mask[5]


def test_torch_out_dtype_device_and_no_grad():
    t32 = TRAIN.float().clone().requires_grad_(True)
    c = C.token_tis(t32, ROLL.float(), MASK)
    assert c.weights.dtype == torch.float32 and c.mask.dtype == torch.bool
    assert not c.weights.requires_grad and c.weights.device == t32.device
    assert C.token_tis(TRAIN, ROLL, MASK).weights.dtype == torch.float64
    bf = C.token_tis(TRAIN.bfloat16(), ROLL.bfloat16(), MASK)
    assert bf.weights.dtype == torch.float32
    c01 = C.token_tis(TRAIN, ROLL, MASK.int())                     # 0/1 mask
    assert torch.equal(c01.mask, C.token_tis(TRAIN, ROLL, MASK).mask)


def test_mean_ratio_agrees_with_gap_tool():
    rng = np.random.default_rng(0)
    b = -rng.exponential(1.0, (4, 50))
    a = np.minimum(b + rng.normal(0, 0.05, b.shape), 0)
    m = np.arange(50)[None] < np.array([[50], [10], [33], [1]])
    c = C.token_tis(a, b, m)
    assert c.metrics["mean_ratio"] == pytest.approx(gap.measure(a, b, m).ratio_mean, rel=1e-13, abs=0)


@st.composite
def padded_batches(draw):
    bsz = draw(st.integers(1, 5))
    t = draw(st.integers(1, 9))
    vals = st.floats(-6, 6, allow_nan=False)
    d = np.array(draw(st.lists(vals, min_size=bsz * t, max_size=bsz * t))).reshape(bsz, t)
    m = np.array(draw(st.lists(st.booleans(), min_size=bsz * t, max_size=bsz * t))).reshape(bsz, t)
    return d, m


@settings(max_examples=40, deadline=None)
@given(padded_batches(), st.floats(1.01, 10))
def test_caps_and_masks_properties(batch, cap):
    d, m = batch
    roll = np.zeros_like(d) - 1.0
    tr = roll + d
    r = np.exp(tr - roll)
    tis = C.token_tis(tr, roll, m, cap=cap)
    assert (tis.weights <= cap).all()                              # exactly, no tolerance
    np.testing.assert_allclose(tis.weights[m], np.minimum(r, cap)[m], rtol=1e-12)
    assert (tis.weights[~m] == 0).all() and (tis.mask == m).all()
    seq = C.sequence_tis(tr, roll, m, cap=cap)
    assert (seq.weights <= cap).all()
    for i in range(d.shape[0]):
        w = seq.weights[i][m[i]]
        assert (w == w[:1]).all()                                  # one weight per sequence
        if m[i].any():
            assert w[0] == pytest.approx(min(math.exp((tr - roll)[i][m[i]].sum()), cap), rel=1e-12, abs=0)
    for c in (C.token_mask(tr, roll, m, hi=cap), C.masked_is(tr, roll, m, hi=cap),
              C.geometric_mask(tr, roll, m, hi=cap), C.product_mask(tr, roll, m, hi=cap),
              C.outlier_veto(tr, roll, m, lo=1 / cap, hi=cap)):
        assert not (c.mask & ~m).any()                             # never keeps padding
        assert (c.loss_weights[~c.mask] == 0).all()
        kept = c.mask
        assert ((r[kept] >= 1 / cap * (1 - 1e-12)).all() and (r[kept] <= cap * (1 + 1e-12)).all()) or \
            c.name in ("geometric_mask", "product_mask")
        frac = (m.sum() - kept.sum()) / max(m.sum(), 1)
        assert c.metrics["frac_tokens_masked"] == pytest.approx(frac, abs=1e-12)
    veto = C.outlier_veto(tr, roll, m, lo=1 / cap, hi=cap)
    tm = C.token_mask(tr, roll, m, lo=1 / cap, hi=cap)
    for i in range(d.shape[0]):                                    # veto = "token mask drops none"
        assert veto.mask[i].any() == (m[i].any() and (tm.mask[i] == m[i]).all())


def _skyrl_reference(d, m, veto_lo, tm_hi, cap, geo_hi):
    """SkyRL's pipeline written out per sequence: veto -> token mask -> sequence TIS -> geo mask."""
    w, keep = np.zeros_like(d), np.zeros_like(m)
    for i in range(d.shape[0]):
        v = m[i].copy()
        if (d[i][v] < math.log(veto_lo)).any():
            v[:] = False
        v &= (d[i] >= -math.log(tm_hi)) & (d[i] <= math.log(tm_hi))
        s, n = d[i][v].sum(), v.sum()
        w[i][v] = min(math.exp(s), cap)
        g = s / max(n, 1)
        if -math.log(geo_hi) <= g <= math.log(geo_hi):
            keep[i] = v
    return w, keep


def _verl_reference(d, m, veto_lo, tm_hi, cap, geo_hi):
    """verl: every part on the original mask, then multiply / AND."""
    w, keep = np.zeros_like(d), np.zeros_like(m)
    for i in range(d.shape[0]):
        v = m[i]
        s, n = d[i][v].sum(), v.sum()
        w[i][v] = min(math.exp(s), cap)
        ok = not (d[i][v] < math.log(veto_lo)).any() and -math.log(geo_hi) <= s / max(n, 1) <= math.log(geo_hi)
        keep[i] = v & (d[i] >= -math.log(tm_hi)) & (d[i] <= math.log(tm_hi)) & ok
    return w, keep


@settings(max_examples=40, deadline=None)
@given(padded_batches(), st.floats(1.5, 20), st.floats(1.5, 10), st.floats(1.01, 10))
def test_combine_orders_match_written_out_pipelines(batch, tm_hi, cap, geo_hi):
    d, m = batch
    roll = np.zeros_like(d) - 1.0
    tr = roll + d
    d = tr - roll
    parts = (C.geometric_mask(tr, roll, m, hi=geo_hi), C.sequence_tis(tr, roll, m, cap=cap),
             C.token_mask(tr, roll, m, hi=tm_hi), C.outlier_veto(tr, roll, m, lo=0.05))
    for order, ref in (("skyrl", _skyrl_reference), ("verl", _verl_reference)):
        c = C.combine(*parts, order=order)
        w, keep = ref(d, m, 0.05, tm_hi, cap, geo_hi)
        assert (np.asarray(c.mask) == keep).all(), order
        np.testing.assert_allclose(np.asarray(c.loss_weights), w * keep, rtol=1e-12, atol=0)
        assert (np.asarray(c.weights) <= cap).all()


def test_errors():
    bad = TRAIN.clone()
    bad[0, 1] = float("inf")
    with pytest.raises(InputError) as e:
        C.token_tis(bad, ROLL, MASK)
    assert (e.value.row, e.value.field, e.value.index) == (0, "trainer_logprobs", 1)
    flat_r = ROLL[MASK].clone()
    flat_r[4] = float("nan")
    with pytest.raises(InputError) as e:
        C.masked_is(TRAIN[MASK], flat_r, cu_seqlens=CU)
    assert (e.value.row, e.value.field, e.value.index) == (1, "rollout_logprobs", 1)
    with pytest.raises(InputError) as e:
        C.token_tis(TRAIN, ROLL[:, :2], MASK)
    assert e.value.field == "rollout_logprobs"
    with pytest.raises(InputError) as e:
        C.token_tis(TRAIN, ROLL, MASK[:, :2])
    assert e.value.field == "mask"
    m2 = MASK.int()
    m2[1, 0] = 3
    with pytest.raises(InputError) as e:
        C.token_tis(TRAIN, ROLL, m2)
    assert (e.value.row, e.value.field, e.value.index) == (1, "mask", 0)
    for kw in (dict(cu_seqlens=torch.tensor([0, 2, 4])), dict(cu_seqlens=torch.tensor([0, 4, 3, 5]))):
        with pytest.raises(InputError) as e:
            C.token_tis(TRAIN[MASK], ROLL[MASK], **kw)
        assert e.value.field == "cu_seqlens"
    with pytest.raises(InputError):
        C.token_tis(TRAIN, ROLL, MASK, cu_seqlens=CU)
    with pytest.raises(InputError):
        C.token_mask(TRAIN, ROLL, MASK, lo=3.0, hi=2.0)
    with pytest.raises(InputError):
        C.token_tis(TRAIN, ROLL, MASK, cap=0.0)
    with pytest.raises(InputError):
        C.token_tis(torch.zeros(0), torch.zeros(0))
    with pytest.raises(InputError):
        C.combine()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_in_cuda_out():
    dev = torch.device("cuda")
    c = C.masked_is(TRAIN.float().to(dev), ROLL.float().to(dev), MASK.to(dev), hi=2.0)
    assert c.weights.device.type == "cuda" and c.mask.device.type == "cuda"
    cpu = C.masked_is(TRAIN.float(), ROLL.float(), MASK, hi=2.0)
    torch.testing.assert_close(c.weights.cpu(), cpu.weights)
    assert c.metrics == cpu.metrics
    flat = C.sequence_tis(TRAIN[MASK].to(dev), ROLL[MASK].to(dev), cu_seqlens=CU.to(dev), cap=2.0)
    torch.testing.assert_close(flat.weights.cpu(), C.sequence_tis(TRAIN, ROLL, MASK, cap=2.0).weights[MASK])
    rep = gap.measure(TRAIN.to(dev), ROLL.to(dev), MASK.to(dev))
    assert rep.n_tokens == 5


# ---- inputs that used to be taken as something else ------------------------------------
ALL = [C.token_tis, C.sequence_tis, C.geometric_mask, C.product_mask, C.outlier_veto,
       C.token_mask, C.masked_is]


def _kw(fn):
    return {"cap": 2.0} if fn in (C.token_tis, C.sequence_tis) else {"hi": 2.0}


@pytest.mark.parametrize("fn", ALL, ids=lambda f: f.__name__)
def test_inputs_that_are_not_logprob_arrays_are_refused(fn):
    flat = torch.tensor([-1.0, -2.0, -0.5])
    cases = [
        (torch.tensor([-1.0, -2.0, -0.5], dtype=torch.complex128), flat, {}, "trainer_logprobs"),
        (np.array([True, False, True]), flat.numpy(), {}, "trainer_logprobs"),
        (np.float64(-1.0), np.float64(-1.0), {}, "trainer_logprobs"),     # 0-d: not widened
        (flat, flat, {"cu_seqlens": np.array([0, 1.9, 3])}, "cu_seqlens"),  # not truncated
        (flat, flat, {"cu_seqlens": torch.tensor([0.0, 2.0, 3.0])}, "cu_seqlens"),
    ]
    for a, b, kw, field in cases:
        with pytest.raises(InputError) as e:
            fn(a, b, **kw, **_kw(fn))
        assert e.value.field == field, (a, str(e.value))


@pytest.mark.parametrize("fn", ALL, ids=lambda f: f.__name__)
@pytest.mark.parametrize("bad", ["2", True, None, [2.0]])
def test_thresholds_that_are_not_numbers_are_refused(fn, bad):
    x = torch.tensor([-1.0, -2.0])
    key = "cap" if fn in (C.token_tis, C.sequence_tis) else "hi"
    if bad is None and key == "hi" and fn is C.outlier_veto:
        return                                  # (hi=None is outlier_veto's "no upper side")
    with pytest.raises(InputError) as e:
        fn(x, x, **{key: bad})
    assert e.value.field == "bounds"


def test_outlier_veto_refuses_lo_above_hi():
    x = torch.tensor([-1.0, -2.0])
    with pytest.raises(InputError, match="lower bound"):
        C.outlier_veto(x, x, lo=3.0, hi=2.0)


# -- TRL's options: lower clip, lo=0, order="trl", denominator="valid" ----------------------------
def test_floor_clips_from_below_and_is_checked():
    tr, ro = torch.log(torch.tensor([[3.0, 0.6, 0.2]])), torch.zeros(1, 3)
    t = C.token_tis(tr, ro, cap=2.0, floor=0.5)
    assert t.weights.tolist() == [[2.0, pytest.approx(0.6), 0.5]] and t.metrics["frac_tokens_clipped"] == 2 / 3
    s = C.sequence_tis(tr, ro, cap=5.0, floor=0.5)                # Π r = 0.36 -> 0.5
    assert s.weights.tolist() == [[0.5, 0.5, 0.5]] and s.metrics["frac_seqs_clipped"] == 1.0
    with pytest.raises(InputError, match="floor") as e:
        C.token_tis(tr, ro, cap=2.0, floor=3.0)
    assert e.value.field == "bounds"
    with pytest.raises(InputError):
        C.sequence_tis(tr, ro, floor=-1.0)
    with pytest.raises(InputError, match="SkyRL") as e:
        C.combine(C.token_tis(tr, ro, cap=2.0, floor=0.5), order="skyrl_exact")
    assert (e.value.field, e.value.index) == ("corrections", 0)


def test_lo_zero_is_no_lower_bound():
    tr, ro = torch.log(torch.tensor([[1e-30, 1.0, 5.0]], dtype=torch.float64)), torch.zeros(1, 3, dtype=torch.float64)
    assert C.masked_is(tr, ro, lo=0, hi=2.0).mask.tolist() == [[True, True, False]]
    assert C.token_mask(tr, ro, lo=0.0, hi=float("inf")).mask.tolist() == [[True, True, True]]


def test_combine_trl_and_the_valid_denominator():
    tr, ro = torch.log(torch.tensor([[3.0, 0.6, 1.5], [0.25, 1.2, 1.0]])), torch.zeros(2, 3)
    m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    kept = C.combine(C.masked_is(tr, ro, m, lo=0.5, hi=2.0, cap=float("inf")), order="trl")
    valid = C.combine(C.masked_is(tr, ro, m, lo=0.5, hi=2.0, cap=float("inf")), order="trl", denominator="valid")
    assert kept.mask.tolist() == [[False, True, True], [False, True, False]]
    assert valid.mask.tolist() == m.bool().tolist()                 # rejected tokens stay in Σ mask
    assert torch.equal(valid.weights, kept.loss_weights) and valid.weights[0, 0] == 0
    assert valid.metrics["frac_tokens_masked"] == kept.metrics["frac_tokens_masked"] == 2 / 5
    seq = C.combine(C.sequence_tis(tr, ro, m, cap=float("inf")), C.product_mask(tr, ro, m, lo=0.5, hi=3.0), order="trl")
    assert seq.mask.tolist() == [[True] * 3, [False] * 3]           # Π r = 2.7 (float32: 2.7000003), 0.3
    with pytest.raises(InputError, match="TRL") as e:
        C.combine(C.token_tis(tr, ro, m), C.geometric_mask(tr, ro, m), order="trl")
    assert (e.value.field, e.value.index) == ("corrections", 1)
    with pytest.raises(InputError) as e:
        C.combine(C.token_tis(tr, ro, m), denominator="tokens")
    assert e.value.field == "denominator"
