"""gap.measure: hand-computed vectors, layouts, properties, fast pass == reference, errors."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skyrl_numerics.gap import fast
from skyrl_numerics import gap
from skyrl_numerics.errors import InputError
from skyrl_numerics.gap import GapReport, measure, measure_reference

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Two sequences, chosen so every d is exact in binary floating point:
#   seq 0: trainer [-1, -2, -0.5],  rollout [-1, -1.5, -0.75]  -> d = [0, -0.5, 0.25]
#   seq 1: trainer [-3, -0.125],    rollout [-2, -0.125]       -> d = [-1, 0]
T0, R0 = [-1.0, -2.0, -0.5], [-1.0, -1.5, -0.75]
T1, R1 = [-3.0, -0.125], [-2.0, -0.125]
PAD_T = np.array([T0, T1 + [0.0]])
PAD_R = np.array([R0, R1 + [0.0]])
PAD_M = np.array([[1, 1, 1], [1, 1, 0]], bool)
FLAT_T, FLAT_R, CU = np.array(T0 + T1), np.array(R0 + R1), np.array([0, 3, 5])

# Hand values (d = [0, -0.5, 0.25, -1, 0], N = 5, r = e^d):
HAND = {
    "n_tokens": 5, "n_seqs": 2,
    "mean_abs": 0.35,                       # (0 + .5 + .25 + 1 + 0) / 5
    "max_abs": 1.0,
    "p50_abs": 0.25,                        # sorted |d| = [0, 0, .25, .5, 1]; h = 4 * .5 = 2
    "p99_abs": 0.98,                        # h = 3.96: .5 + .96 * (1 - .5)
    "frac_bitwise_equal": 0.4,              # tokens 0 and 4
    "kl_k1": 0.25,                          # -(-1.25) / 5
    "kl_k2": 0.13125,                       # (.25 + .0625 + 1) / 2 / 5
    "kl_k3": 0.10168710351436343,           # Σ(e^d - 1 - d)/5 = (.10653 + .03403 + .36788)/5
    "chi2": -0.1696128009783633,            # (1 + e^-1 + e^.5 + e^-2 + 1)/5 - 1
    "ppl_ratio": 1.2840254166877414,        # e^0.25
    "ess": 0.8735333626858881,              # (Σr)² / (5 Σr²)
    "ratio_mean": 0.8516871035143634,       # Σr / 5
    "ratio_std": 0.3240621494851729,        # population std of r
    "ratio_min": 0.36787944117144233,       # e^-1
    "ratio_max": 1.2840254166877414,        # e^0.25
    "ratio_p1": 0.37742548991309,           # sorted r: e^-1 + .04 (e^-.5 - e^-1)
    "ratio_p99": 1.2726644000202318,        # 1 + .96 (e^.25 - 1)
    "F_1.5": 0.4,                           # |d| > ln 1.5 = .405: -.5 and -1
    "F_2": 0.2,                             # |d| > ln 2 = .693: -1
    "F_5": 0.0,
}


def _check_hand(rep: GapReport):
    s = rep.summary()
    assert list(s) == list(HAND)
    for k, v in HAND.items():
        assert s[k] == pytest.approx(v, rel=1e-13, abs=1e-15), k
    np.testing.assert_allclose(rep.position_mean_abs, [0.5, 0.25, 0.25], rtol=1e-15)
    np.testing.assert_array_equal(rep.position_count, [2, 2, 1])
    np.testing.assert_array_equal(rep.seq_len, [3, 2])
    np.testing.assert_allclose(rep.seq_mean_abs, [0.25, 0.5], rtol=1e-15)
    np.testing.assert_allclose(rep.seq_max_abs, [0.5, 1.0], rtol=1e-15)
    np.testing.assert_allclose(rep.seq_log_ratio, [-0.25, -1.0], rtol=1e-15)
    np.testing.assert_allclose(rep.seq_geo_ratio, [math.exp(-0.25 / 3), math.exp(-0.5)], rtol=1e-14)


@pytest.mark.parametrize("path", ["reference", "fast"])
@pytest.mark.parametrize("layout", ["padded", "ragged", "flat", "torch_padded"])
def test_hand_vector_every_layout(layout, path):
    if layout == "padded":
        rep = measure(PAD_T, PAD_R, PAD_M, _path=path)
    elif layout == "ragged":
        rep = measure([np.array(T0), T1], [R0, np.array(R1)], _path=path)
    elif layout == "flat":
        rep = measure(FLAT_T, FLAT_R, cu_seqlens=CU, _path=path)
    else:
        rep = measure(torch.tensor(PAD_T), torch.tensor(PAD_R), torch.tensor(PAD_M), _path=path)
    _check_hand(rep)


def test_published_formulas_literally():
    """The report equals the textbook formulas written out on the full arrays."""
    rng = np.random.default_rng(3)
    b = -rng.exponential(2.0, 400)
    a = np.minimum(b + rng.normal(0, 0.3, 400), 0)
    d = a - b
    r = np.exp(d)
    rep = measure(a, b)
    assert rep.kl_k1 == pytest.approx(np.mean(-d), rel=1e-12, abs=0)
    assert rep.kl_k2 == pytest.approx(np.mean(d * d / 2), rel=1e-12, abs=0)
    assert rep.kl_k3 == pytest.approx(np.mean(r - 1 - d), rel=1e-10, abs=0)
    assert rep.chi2 == pytest.approx(np.mean(r * r) - 1, rel=1e-10, abs=0)
    assert rep.ppl_ratio == pytest.approx(np.exp(np.mean(-a)) / np.exp(np.mean(-b)), rel=1e-12, abs=0)
    assert rep.ess == pytest.approx(r.sum() ** 2 / (r.size * (r * r).sum()), rel=1e-12, abs=0)
    assert rep.ratio_std == pytest.approx(np.std(r), rel=1e-12, abs=0)
    for tau, f in rep.extreme_frac.items():
        assert f == np.mean(np.maximum(r, 1 / r) > tau)
    assert rep.p99_abs == np.quantile(np.abs(d), 0.99)


def test_bf16_and_dtypes_recorded():
    t = torch.tensor([[-1.0, -2.5, -0.25]], dtype=torch.bfloat16)
    r = torch.tensor([[-1.0, -2.0, -0.25]], dtype=torch.float32)
    rep = measure(t, r)
    assert rep.dtypes == ("bfloat16", "float32")
    assert rep.frac_bitwise_equal == pytest.approx(2 / 3)
    assert rep.max_abs == 0.5


def test_mixed_dtype_equality_is_exact_value_equality():
    a = np.array([-0.1, -0.5], np.float32)
    b = np.array([-0.1, -0.5], np.float64)     # -0.1 differs between f32 and f64, -0.5 does not
    assert measure(a, b).frac_bitwise_equal == 0.5


def test_taus_custom_and_keys():
    rep = measure(FLAT_T, FLAT_R, cu_seqlens=CU, taus=(1.2, 3))
    assert list(rep.extreme_frac) == [1.2, 3.0]
    assert "F_1.2" in rep.summary() and "F_3" in rep.summary()
    assert rep.extreme_frac[1.2] == 0.6            # |d| > ln 1.2 = .182: .5, .25 and 1
    assert rep.extreme_frac[3.0] == 0.0            # |d| > ln 3 = 1.0986: none


def test_to_dict_is_json_and_round_trips():
    rep = measure([np.array(T0), np.array([]), np.array(T1)], [R0, [], R1])   # an empty sequence
    d = rep.to_dict()
    text = json.dumps(d, allow_nan=False)
    back = GapReport.from_dict(json.loads(text))
    assert back == rep
    assert d["per_sequence"]["mean_abs"][1] is None and d["per_sequence"]["len"] == [3, 0, 2]
    assert rep.n_seqs == 3 and rep.n_tokens == 5


# -- properties -------------------------------------------------------------------------------
def _logprobs(draw, n):
    # dyadic values in [-16, 0]: sums and shifts stay exact
    ints = draw(st.lists(st.integers(-16 * 64, 0), min_size=n, max_size=n))
    return np.array(ints, np.float64) / 64


@st.composite
def batches(draw, max_seqs=6, max_len=12):
    lens = draw(st.lists(st.integers(0, max_len), min_size=1, max_size=max_seqs))
    if sum(lens) == 0:
        lens[0] = 1
    n = sum(lens)
    a = _logprobs(draw, n)
    b = _logprobs(draw, n)
    eq = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), bool)
    b[eq] = a[eq]
    return a, b, np.array(lens)


def _ragged(x, lens):
    cu = np.concatenate([[0], np.cumsum(lens)])
    return [x[cu[i]:cu[i + 1]] for i in range(len(lens))]


def _padded(x, lens):
    t = max(lens)
    out = np.full((len(lens), t), np.nan)    # padding holds NaN: must never be read
    m = np.arange(t)[None, :] < np.array(lens)[:, None]
    out[m] = x
    return out, m


@SETTINGS
@given(batches())
def test_padded_equals_ragged_equals_flat(batch):
    a, b, lens = batch
    cu = np.concatenate([[0], np.cumsum(lens)])
    flat = measure(a, b, cu_seqlens=cu)
    ragged = measure(_ragged(a, lens), _ragged(b, lens))
    pa, m = _padded(a, lens)
    pb, _ = _padded(b, lens)
    padded = measure(pa, pb, m)
    assert flat == ragged == padded
    # a flat mask selecting the same tokens out of a longer stream gives the same report too
    keep = np.ones(a.size + 2, bool)
    keep[[0, -1]] = False
    big_a = np.insert(a, [0, a.size], np.nan)          # NaN at masked-out places
    big_b = np.insert(b, [0, a.size], np.nan)
    big_lens = lens.copy()
    big_lens[0] += 1
    big_lens[-1] += 1
    masked = measure(big_a, big_b, keep, cu_seqlens=np.concatenate([[0], np.cumsum(big_lens)]))
    assert masked == flat


@SETTINGS
@given(batches(), st.randoms(use_true_random=False))
def test_sequence_order_does_not_matter(batch, rnd):
    a, b, lens = batch
    ra, rb = _ragged(a, lens), _ragged(b, lens)
    perm = list(range(len(lens)))
    rnd.shuffle(perm)
    r1 = measure(ra, rb)
    r2 = measure([ra[i] for i in perm], [rb[i] for i in perm])
    assert r2.summary() == pytest.approx(r1.summary(), rel=1e-12, abs=1e-15)
    np.testing.assert_array_equal(r2.seq_len, r1.seq_len[perm])
    np.testing.assert_allclose(r2.seq_mean_abs, r1.seq_mean_abs[perm], rtol=1e-15)
    np.testing.assert_allclose(r2.position_mean_abs, r1.position_mean_abs, rtol=1e-12)


@SETTINGS
@given(batches())
def test_zero_gap_gives_identity_values(batch):
    a, _, lens = batch
    rep = measure(_ragged(a, lens), _ragged(a.copy(), lens))
    s = rep.summary()
    for k in ("mean_abs", "max_abs", "p50_abs", "p99_abs", "kl_k1", "kl_k2", "kl_k3", "chi2",
              "ratio_std", "F_1.5", "F_2", "F_5"):
        assert s[k] == 0.0, k
    for k in ("frac_bitwise_equal", "ess", "ppl_ratio", "ratio_mean", "ratio_min", "ratio_max",
              "ratio_p1", "ratio_p99"):
        assert s[k] == 1.0, k


@SETTINGS
@given(batches())
def test_swap_and_shift_and_scale(batch):
    a, b, lens = batch
    cu = np.concatenate([[0], np.cumsum(lens)])
    base = measure(a, b, cu_seqlens=cu)
    swap = measure(b, a, cu_seqlens=cu)                          # d -> -d
    for k in ("mean_abs", "max_abs", "p50_abs", "p99_abs", "kl_k2", "frac_bitwise_equal"):
        assert getattr(swap, k) == getattr(base, k), k
    assert swap.kl_k1 == -base.kl_k1
    assert swap.extreme_frac == base.extreme_frac
    assert swap.ratio_min == pytest.approx(1 / base.ratio_max, rel=1e-15, abs=0)
    shift = measure(a - 3.0, b - 3.0, cu_seqlens=cu)             # exact for these dyadic values
    assert shift.summary() == base.summary()
    half = measure(a / 2, b / 2, cu_seqlens=cu)                  # d -> d/2 exactly
    assert half.mean_abs == base.mean_abs / 2 and half.p99_abs == base.p99_abs / 2
    assert half.kl_k2 == pytest.approx(base.kl_k2 / 4, rel=1e-15, abs=0)


@SETTINGS
@given(st.lists(st.floats(-50, 50, allow_nan=False), min_size=1, max_size=40),
       st.sampled_from([0.0, 0.01, 0.25, 0.5, 0.99, 1.0]))
def test_quantile_matches_numpy_bitwise(xs, q):
    x = np.sort(np.array(xs))
    lo, hi, g = fast._q_index(x.size, q)
    assert fast._lerp(x[lo], x[hi], g) == np.quantile(x, q)


# -- the fast pass against the reference ------------------------------------------------------
def _close(fast: GapReport, ref: GapReport):
    fs, rs = fast.summary(), ref.summary()
    exact = ("n_tokens", "n_seqs", "max_abs", "p50_abs", "p99_abs", "frac_bitwise_equal",
             "ratio_min", "ratio_max", "ratio_p1", "ratio_p99", "F_1.5", "F_2", "F_5")
    for k in fs:
        if k in exact:
            assert fs[k] == rs[k], k
        else:   # sums in another order; Taylor (error < 1e-12) vs expm1 on tiny d
            assert fs[k] == pytest.approx(rs[k], rel=1e-9, abs=1e-300), k
    np.testing.assert_array_equal(fast.position_count, ref.position_count)
    np.testing.assert_allclose(fast.position_mean_abs, ref.position_mean_abs, rtol=1e-12)
    np.testing.assert_array_equal(fast.seq_max_abs, ref.seq_max_abs)
    np.testing.assert_allclose(fast.seq_mean_abs, ref.seq_mean_abs, rtol=1e-12)
    np.testing.assert_allclose(fast.seq_log_ratio, ref.seq_log_ratio, rtol=1e-12, atol=1e-300)


def _synthetic(n, scale, rng, dtype=np.float32, zero_frac=0.3, bias=0.0):
    b = (-rng.exponential(1.5, n)).astype(dtype)
    a = np.minimum(b.astype(np.float64) + bias + rng.normal(0, scale, n), 0).astype(dtype)
    eq = rng.random(n) < zero_frac
    a[eq] = b[eq]
    return a, b


def _cu(n, rng, max_len=700, empties=True):
    lens = rng.integers(0 if empties else 1, max_len, n // 100 + 2)
    cu = np.concatenate([[0], np.cumsum(lens)])
    cu = cu[cu < n]
    return np.append(cu, n)


CASES = {
    "bf16-like small gap": dict(scale=1e-3),
    "large gap": dict(scale=0.5),
    "tiny gap": dict(scale=1e-7, zero_frac=0.1),
    "mostly bitwise equal": dict(scale=1e-3, zero_frac=0.995),
    "all equal": dict(scale=1e-3, zero_frac=1.0),
    "systematic bias": dict(scale=1e-4, bias=-5e-3, zero_frac=0.0),
    "float64": dict(scale=1e-3, dtype=np.float64),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fast_pass_matches_reference(case):
    rng = np.random.default_rng(len(case))
    n = 60_000
    a, b = _synthetic(n, rng=rng, **CASES[case])
    cu = _cu(n, rng)
    _close(measure(a, b, cu_seqlens=cu, _path="fast"), measure_reference(a, b, cu_seqlens=cu))


def test_fast_pass_matches_reference_padded_masked_and_uniform():
    rng = np.random.default_rng(7)
    a, b = _synthetic(64 * 500, 1e-3, rng)
    a, b = a.reshape(64, 500), b.reshape(64, 500)
    _close(measure(a, b, _path="fast"), measure_reference(a, b))               # uniform lengths
    m = np.arange(500)[None, :] < rng.integers(0, 500, 64)[:, None]
    m[:, 0] = True
    m[3] = False                                                                # an empty row
    m[5, 100:200] = False                                                       # a hole
    _close(measure(a, b, m, _path="fast"), measure_reference(a, b, m))


def test_fast_pass_long_sequences():
    rng = np.random.default_rng(17)
    a, b = _synthetic(90_000, 1e-3, rng)
    cu = np.array([0, 3000, 3000, 10_000, 12_500, 40_000, 90_000])      # long, one empty
    _close(measure(a, b, cu_seqlens=cu, _path="fast"), measure_reference(a, b, cu_seqlens=cu))


@pytest.mark.parametrize("chunk", [1000, 3000])
def test_fast_pass_small_chunks_split_sequences(chunk):
    """Chunks smaller than the sequences: long sequences are cut into pieces and merged back."""
    rng = np.random.default_rng(11)
    a, b = _synthetic(20_000, 0.5, rng)
    cu = np.sort(np.concatenate([_cu(20_000, rng, max_len=5000), [7000, 7000, 19_990]]))
    tok = gap.normalize(a, b, None, cu)
    for threads in (1, 3):
        st_ = fast.fast_stats(tok, gap.DEFAULT_TAUS, gap.LOGPROB_TOL, chunk=chunk, threads=threads)
        _close(gap._finish(st_, tok, gap.DEFAULT_TAUS), measure_reference(a, b, cu_seqlens=cu))
    one = gap.normalize(a, b, None, None)                     # a single 20K-token sequence
    st_ = fast.fast_stats(one, gap.DEFAULT_TAUS, gap.LOGPROB_TOL, chunk=chunk)
    _close(gap._finish(st_, one, gap.DEFAULT_TAUS), measure_reference(a, b))


def test_fast_pass_huge_ratio_falls_back():
    rng = np.random.default_rng(11)
    a, b = _synthetic(20_000, 0.5, rng)
    cu = _cu(20_000, rng)
    b2 = b.astype(np.float64)
    b2[17] = -400.0                  # r = e^400: the fast pass hands over to the reference
    assert fast.fast_stats(gap.normalize(a.astype(np.float64), b2, None, cu), gap.DEFAULT_TAUS, 1e-6) is None
    rep = measure(a.astype(np.float64), b2, cu_seqlens=cu, _path="fast")
    assert rep.ratio_max > 1e170 and rep.chi2 == math.inf and 0 < rep.ess < 1e-3
    assert rep.to_dict()["summary"]["chi2"] is None


@pytest.mark.parametrize("top,order", [(1e-4, 4), (2e-3, 5), (1 / 64, 6)])
def test_fast_pass_taylor_part_is_accurate_to_1e12(top, order):
    """Tokens with |d| <= T go through the series of order K(T); hold it to fsum(expm1) values."""
    rng = np.random.default_rng(2)
    d = rng.uniform(top / 20, top, 50_000) * rng.choice([-1, 1], 50_000)
    b = -rng.uniform(1, 5, 50_000)
    a = b + d
    d = a - b                                        # the d the tool sees
    T = fast._brackets(gap.normalize(a, b, None, None), gap.DEFAULT_TAUS)[0]
    assert fast._taylor_order(T) == order and T <= fast._TAYLOR_MAX
    rep = measure(a, b, _path="fast")
    n = d.size
    assert rep.kl_k3 == pytest.approx(math.fsum(np.expm1(d) - d) / n, rel=1e-12, abs=0)
    assert rep.chi2 == pytest.approx(math.fsum(np.expm1(2 * d)) / n, rel=1e-12, abs=0)
    assert rep.ratio_mean == pytest.approx(1 + math.fsum(np.expm1(d)) / n, rel=1e-15, abs=0)


def test_fast_pass_threads_agree():
    rng = np.random.default_rng(13)
    a, b = _synthetic(80_000, 1e-3, rng)
    cu = _cu(80_000, rng)
    tok = gap.normalize(a, b, None, cu)
    one = fast.fast_stats(tok, gap.DEFAULT_TAUS, 1e-6, chunk=4096, threads=1)
    three = fast.fast_stats(tok, gap.DEFAULT_TAUS, 1e-6, chunk=4096, threads=3)
    ref = measure_reference(a, b, cu_seqlens=cu)
    _close(gap._finish(one, tok, gap.DEFAULT_TAUS), ref)
    _close(gap._finish(three, tok, gap.DEFAULT_TAUS), ref)
    # runs of chunks are the unit of work and are combined in run order: same bits for any threads
    _same_stats(one, three)
    for kernel in ("numpy", "numba") if _has_numba() else ("numpy",):
        two = fast.fast_stats(tok, gap.DEFAULT_TAUS, 1e-6, chunk=4096, threads=2, kernel=kernel)
        _same_stats(one, two)


@SETTINGS
@given(batches(max_seqs=8, max_len=40), st.integers(0, 2 ** 32 - 1))
def test_fast_pass_matches_reference_property(batch, seed):
    a, b, lens = batch
    rng = np.random.default_rng(seed)
    b = b + rng.normal(0, 1e-3, b.size) * (rng.random(b.size) < 0.7)
    b = np.minimum(b, 0)
    cu = np.concatenate([[0], np.cumsum(lens)])
    _close(measure(a, b, cu_seqlens=cu, _path="fast"), measure_reference(a, b, cu_seqlens=cu))


@SETTINGS
@given(batches(max_seqs=10, max_len=60), st.integers(0, 2 ** 32 - 1), st.integers(3, 70), st.integers(1, 3))
def test_fast_pass_any_chunking_matches_reference(batch, seed, chunk, threads):
    """Tiny chunks: sequences split into pieces, runs cut anywhere, several threads."""
    a, b, lens = batch
    rng = np.random.default_rng(seed)
    b = np.minimum(b + rng.normal(0, 1e-3, b.size) * (rng.random(b.size) < 0.7), 0)
    cu = np.concatenate([[0], np.cumsum(lens)])
    tok = gap.normalize(a, b, None, cu)
    st_ = fast.fast_stats(tok, gap.DEFAULT_TAUS, gap.LOGPROB_TOL, chunk=chunk, threads=threads)
    if st_ is None:   # small inputs: the sample is the whole batch, so only the std guard may refuse
        u = np.expm1(a - b)
        assert np.var(u) <= 1.01e-3 * np.mean(u * u)
        return
    ref = measure_reference(a, b, cu_seqlens=cu)
    _close(gap._finish(st_, tok, gap.DEFAULT_TAUS), ref)
    (pa, m), (pb, _) = _padded(a, lens), _padded(b, lens)
    ptok = gap.normalize(pa, pb, m)                          # padded + mask, same tokens
    pst = fast.fast_stats(ptok, gap.DEFAULT_TAUS, gap.LOGPROB_TOL, chunk=chunk, threads=threads)
    _close(gap._finish(pst, ptok, gap.DEFAULT_TAUS), ref)


# -- errors -----------------------------------------------------------------------------------
def _err(fn, *args, **kw) -> InputError:
    with pytest.raises(InputError) as e:
        fn(*args, **kw)
    return e.value


@pytest.mark.parametrize("path", ["reference", "fast"])
def test_non_finite_named_by_row_field_index(path):
    t = PAD_T.copy()
    t[1, 1] = np.nan
    e = _err(measure, t, PAD_R, PAD_M, _path=path)
    assert (e.row, e.field, e.index) == (1, "trainer_logprobs", 1)
    assert "not finite" in str(e) and "row 1" in str(e)
    r = [R0, [-2.0, np.inf]]
    e = _err(measure, [T0, T1], r, _path=path)
    assert (e.row, e.field, e.index) == (1, "rollout_logprobs", 1)


@pytest.mark.parametrize("path", ["reference", "fast"])
def test_positive_logprob_rejected_zero_and_tolerance_accepted(path):
    ok = measure([[-1.0, 0.0, 5e-7]], [[-1.0, 0.0, 0.0]], _path=path)
    assert ok.n_tokens == 3
    e = _err(measure, [[-1.0, 0.0, 0.5]], [[-1.0, 0.0, 0.0]], _path=path)
    assert (e.row, e.field, e.index) == (0, "trainer_logprobs", 2) and "positive" in str(e)
    e = _err(measure, FLAT_T, np.array([-1, -1, -1, 2e-6, -1.0]), cu_seqlens=CU, _path=path)
    assert (e.row, e.field, e.index) == (1, "rollout_logprobs", 0)


def test_error_location_large_input_fast_pass():
    rng = np.random.default_rng(5)
    a, b = _synthetic(50_000, 1e-3, rng)
    cu = _cu(50_000, rng, empties=False)
    b[40_123] = np.nan
    e = _err(measure, a, b, cu_seqlens=cu, _path="fast")
    row = int(np.searchsorted(cu, 40_123, side="right") - 1)
    assert (e.row, e.field, e.index) == (row, "rollout_logprobs", 40_123 - cu[row])


def test_masked_out_garbage_is_ignored_and_masked_index_maps_back():
    t = PAD_T.copy()
    t[1, 2] = np.nan                 # padding
    _check_hand(measure(t, PAD_R, PAD_M))
    m = np.array([[1, 0, 1], [1, 1, 1]], bool)
    t2 = PAD_T.copy()
    t2[1, 2] = 3.0
    e = _err(measure, t2, PAD_R, m)
    assert (e.row, e.field, e.index) == (1, "trainer_logprobs", 2)
    flat_m = np.array([1, 0, 1, 1, 1], bool)
    ft = FLAT_T.copy()
    ft[4] = np.inf
    e = _err(measure, ft, FLAT_R, flat_m, cu_seqlens=CU)
    assert (e.row, e.field, e.index) == (1, "trainer_logprobs", 1)
    rag_t = [np.array(T0), np.array([-3.0, np.nan])]
    e = _err(measure, rag_t, [R0, R1], [np.array([1, 1, 1]), np.array([0, 1])])
    assert (e.row, e.field, e.index) == (1, "trainer_logprobs", 1)


def test_shape_and_length_errors():
    e = _err(measure, [T0, T1], [R0, R1[:1]])
    assert (e.row, e.field) == (1, "rollout_logprobs") and "length 1, expected 2" in str(e)
    e = _err(measure, [T0, T1], [R0])
    assert e.field == "rollout_logprobs" and "1 sequences, expected 2" in str(e)
    e = _err(measure, PAD_T, PAD_R[:, :2])
    assert e.field == "rollout_logprobs" and "shape" in str(e)
    e = _err(measure, PAD_T, PAD_R, PAD_M[:, :2])
    assert e.field == "mask"
    m = PAD_M.astype(int)
    m[0, 1] = 2
    e = _err(measure, PAD_T, PAD_R, m)
    assert (e.row, e.field, e.index) == (0, "mask", 1)
    e = _err(measure, np.zeros((2, 2, 2)) - 1, np.zeros((2, 2, 2)) - 1)
    assert e.field == "trainer_logprobs"
    e = _err(measure, [T0, T1], PAD_R)
    assert "layout" in str(e)
    e = _err(measure, np.array(["a", "b"]), np.array(["a", "b"]))
    assert "dtype" in str(e)


def test_empty_inputs():
    for args in [([], []), (np.zeros((0, 4)), np.zeros((0, 4))), ([np.array([])], [np.array([])])]:
        assert "empty" in str(_err(measure, *args))
    e = _err(measure, PAD_T, PAD_R, np.zeros_like(PAD_M))
    assert e.field == "mask" and "empty" in str(e)


def test_cu_seqlens_errors():
    for cu, idx in [([1, 3, 5], 0), ([0, 4, 3, 5], 2), ([0, 3, 6], 2)]:
        e = _err(measure, FLAT_T, FLAT_R, cu_seqlens=np.array(cu))
        assert (e.field, e.index) == ("cu_seqlens", idx)
    assert _err(measure, PAD_T, PAD_R, cu_seqlens=CU).field == "cu_seqlens"
    assert _err(measure, [T0], [R0], cu_seqlens=CU).field == "cu_seqlens"


def test_bad_taus():
    e = _err(measure, FLAT_T, FLAT_R, taus=(2.0, 0.5))
    assert (e.field, e.index) == ("taus", 1)
    assert _err(measure, FLAT_T, FLAT_R, taus=("x",)).field == "taus"
    assert _err(measure, FLAT_T, FLAT_R, taus=3.0).field == "taus"          # not a sequence


@pytest.mark.parametrize("path", ["reference", "fast"])
@pytest.mark.parametrize("tol", [float("nan"), float("inf"), -1e-3, "x", None, True])
def test_bad_logprob_tol_is_refused_on_both_paths(path, tol):
    """A NaN tolerance used to switch the positive-logprob check off on the reference path
    (a report over positive "logprobs") and to give a wrong cause on the fast path."""
    pos = np.array([0.5, -1.0, -2.0])
    e = _err(measure, pos, pos - 0.1, logprob_tol=tol, _path=path)
    assert e.field == "logprob_tol"


@pytest.mark.parametrize("path", ["reference", "fast"])
def test_a_gap_of_a_thousand_nats_reports_infinite_ratios(path):
    """Finite, valid logprobs whose difference overflows exp(): inf, not an OverflowError."""
    import warnings

    t = np.array([-0.1, -0.2, -1000.0] * 3)
    r = np.array([-1000.0, -0.2, -0.1] * 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")               # and no numpy overflow warnings
        rep = measure(t, r, _path=path).summary()
    assert rep["ratio_max"] == math.inf and rep["ratio_min"] == 0.0
    assert rep["max_abs"] == pytest.approx(999.9)


def test_import_is_light():
    import subprocess
    import sys

    code = "import sys, skyrl_numerics.gap, skyrl_numerics.correction; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- the optional numba kernel == the numpy scan, bit for bit ---------------------------------
def _same_stats(x: dict, y: dict):
    assert x.keys() == y.keys()
    for k in x:
        a, b = x[k], y[k]
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True), k
        elif isinstance(a, list):
            assert len(a) == len(b) and all(u == v or (u != u and v != v) for u, v in zip(a, b)), k
        else:
            assert type(a) is type(b) and (a == b or (a != a and b != b)), (k, a, b)
        if isinstance(a, float):
            assert math.copysign(1, a) == math.copysign(1, b), k


def _has_numba() -> bool:
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def _both_kernels(tok, **kw):
    pytest.importorskip("numba")
    x = fast.fast_stats(tok, gap.DEFAULT_TAUS, gap.LOGPROB_TOL, kernel="numpy", **kw)
    y = fast.fast_stats(tok, gap.DEFAULT_TAUS, gap.LOGPROB_TOL, kernel="numba", **kw)
    assert (x is None) == (y is None)
    if x is not None:
        _same_stats(x, y)
    return x


@pytest.mark.parametrize("case", list(CASES))
def test_numba_kernel_equals_numpy_bitwise(case):
    rng = np.random.default_rng(len(case) + 100)
    n = 150_000
    a, b = _synthetic(n, rng=rng, **CASES[case])
    cu = _cu(n, rng)
    for threads in (1, 2):
        _both_kernels(gap.normalize(a, b, None, cu), threads=threads)
    m = a.size // 500 * 500                                      # padded + mask, same kernel
    pa, pb = a[:m].reshape(-1, 500), b[:m].reshape(-1, 500)
    mask = np.arange(500)[None, :] < rng.integers(0, 501, m // 500)[:, None]
    mask[:, 0] = True
    mask[2, 100:300] = False
    _both_kernels(gap.normalize(pa, pb, mask), threads=1)


@pytest.mark.parametrize("chunk", [1000, 4096])
def test_numba_kernel_split_and_long_sequences(chunk):
    rng = np.random.default_rng(21)
    a, b = _synthetic(60_000, 1e-3, rng)
    cu = np.array([0, 3000, 3000, 10_000, 12_500, 40_000, 60_000])
    st_ = _both_kernels(gap.normalize(a, b, None, cu), chunk=chunk, threads=3)
    _close(gap._finish(st_, gap.normalize(a, b, None, cu), gap.DEFAULT_TAUS), measure_reference(a, b, cu_seqlens=cu))
    mixed = gap.normalize(a.astype(np.float64), b, None, cu)     # mixed dtypes, float64 data
    _both_kernels(mixed, chunk=chunk)


def test_numba_kernel_flags_bad_values_like_numpy():
    pytest.importorskip("numba")
    rng = np.random.default_rng(5)
    a, b = _synthetic(50_000, 1e-3, rng)
    cu = _cu(50_000, rng, empties=False)
    for bad in (np.nan, np.inf, 1e-5):
        b2 = b.copy()
        b2[40_123] = bad
        tok = gap.normalize(a, b2, None, cu)
        for kernel in ("numpy", "numba"):
            with pytest.raises(InputError) as e:
                fast.fast_stats(tok, gap.DEFAULT_TAUS, gap.LOGPROB_TOL, kernel=kernel)
            assert (e.value.field, e.value.index) == ("rollout_logprobs", 40_123 - cu[e.value.row])
    # float32(1e-6) is above 1e-6: numpy compares in the input dtype, so does the kernel
    a2 = a.copy()
    a2[7] = np.float32(1e-6)
    _both_kernels(gap.normalize(a2, b, None, cu))


@SETTINGS
@given(batches(max_seqs=10, max_len=60), st.integers(0, 2 ** 32 - 1), st.integers(3, 70), st.integers(1, 3),
       st.booleans())
def test_numba_kernel_any_chunking_property(batch, seed, chunk, threads, padded):
    a, b, lens = batch
    rng = np.random.default_rng(seed)
    b = np.minimum(b + rng.normal(0, 1e-3, b.size) * (rng.random(b.size) < 0.7), 0)
    if padded:
        (pa, m), (pb, _) = _padded(a, lens), _padded(b, lens)
        tok = gap.normalize(pa, pb, m)
    else:
        tok = gap.normalize(a, b, None, np.concatenate([[0], np.cumsum(lens)]))
    _both_kernels(tok, chunk=chunk, threads=threads)


@pytest.mark.parametrize("top", [1e-4, 2e-3, 1 / 64])
def test_numba_kernel_bitwise_at_every_taylor_order(top):
    """The kernel always runs the degree-7 Horner form with zero coefficients above K; numpy
    runs the degree-K form: the same bits at K = 4, 5, 6."""
    rng = np.random.default_rng(3)
    d = rng.uniform(top / 20, top, 300_000) * rng.choice([-1, 1], 300_000)
    b = -rng.uniform(1, 5, 300_000)
    tok = gap.normalize(b + d, b, None, _cu(300_000, rng))
    _both_kernels(tok, threads=2)


def test_numpy_lane_sums_are_sequential_per_lane():
    """The order both scans use: ``reshape(-1, LANES).sum(axis=0)`` adds row after row."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=fast.LANES * 300) * np.exp(rng.normal(0, 8, fast.LANES * 300))
    acc = np.zeros(fast.LANES)
    for row in x.reshape(-1, fast.LANES):
        acc = acc + row
    assert np.array_equal(x.reshape(-1, fast.LANES).sum(axis=0), acc)
    h, y = fast.LANES, acc.copy()
    while h > 1:
        h //= 2
        y = y[:h] + y[h:2 * h]
    assert fast._fold(acc) == y[0]


def test_kernel_selection_and_fallbacks(monkeypatch):
    rng = np.random.default_rng(8)
    a, b = _synthetic(20_000, 1e-3, rng)
    tok = gap.normalize(a, b, None, _cu(20_000, rng))
    monkeypatch.setenv("SKYRL_NUMERICS_NUMBA", "0")
    assert fast._pick_kernel(tok, "auto") is None
    monkeypatch.delenv("SKYRL_NUMERICS_NUMBA")
    if _has_numba():
        from skyrl_numerics.gap import numba_scan
        assert fast._pick_kernel(tok, "auto") is numba_scan        # the default when numba imports
        assert numba_scan.LANES == fast.LANES
        # float16 (or non-contiguous) arrays: numpy under "auto", an error when numba is asked for
        tok16 = gap.normalize(a.astype(np.float16), b.astype(np.float16), None, None)
        assert fast._pick_kernel(tok16, "auto") is None
        with pytest.raises(ValueError):
            fast._pick_kernel(tok16, "numba")
    monkeypatch.setattr(fast, "_NB", False)                        # numba missing
    assert fast._pick_kernel(tok, "auto") is None
    with pytest.raises(ImportError):
        fast._pick_kernel(tok, "numba")
    with pytest.raises(ValueError):
        fast._pick_kernel(tok, "cuda")


def test_numba_kernels_cache_to_numba_cache_dir(tmp_path):
    """Compiled once, then loaded from disk: NUMBA_CACHE_DIR (or numba's own fallbacks for a
    read-only install) receives the kernels."""
    pytest.importorskip("numba")
    import os
    import subprocess
    import sys

    code = ("import numpy as np; from skyrl_numerics import gap; rng = np.random.default_rng(0); "
            "b = -rng.random(300_000); a = np.minimum(b + rng.normal(0, 1e-3, b.size), 0); "
            "print(gap.measure(a, b, cu_seqlens=np.array([0, 1000, 300_000])).n_tokens)")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    env.pop("SKYRL_NUMERICS_NUMBA", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "300000"
    assert list(tmp_path.rglob("*numba_scan*.nbi")) and list(tmp_path.rglob("*.nbc"))


@pytest.mark.parametrize("width", [40, 61, 64, 333])
def test_numba_padded_run_check_and_left_padding(width):
    """Padded rows are copied whole when their masked tokens form one run (checked 8 mask bytes
    at a time): left, right and no padding, holes, widths not a multiple of 8."""
    pytest.importorskip("numba")
    from skyrl_numerics.gap import numba_scan

    rng = np.random.default_rng(width)
    rows = 48
    m = np.zeros((rows, width), bool)
    for r in range(rows):
        t0, L = sorted(rng.integers(0, width + 1, 2))
        m[r, t0:L] = True
        if r % 5 == 0 and L - t0 > 2:
            m[r, rng.integers(t0 + 1, L - 1)] = False          # a hole
    m[0] = True
    m8 = m.view(np.uint8)
    m64 = m8.reshape(-1).view(np.uint64) if m8.size % 8 == 0 else np.zeros(0, np.uint64)
    for r in range(rows):
        for t0, t1 in [(0, width), (1, width - 1), (width // 3, width), (0, 1), (2, 2 + width // 2)]:
            assert numba_scan._all_set(m8, m64, r, t0, t1, width) == bool(m[r, t0:t1].all())
    n = rows * width
    a, b = _synthetic(n, 1e-3, rng)
    _both_kernels(gap.normalize(a.reshape(rows, width), b.reshape(rows, width), m), chunk=500, threads=2)


def test_numba_kernels_compile_without_a_cache_location():
    """No writable cache location at all (numba: 'no locator available'): compiled per process."""
    pytest.importorskip("numba")
    from skyrl_numerics.gap import numba_scan

    ns = {}
    exec("def f(x):\n    return x + 1\n", ns)          # noqa: S102 (no source file: no cache locator)
    assert numba_scan._jit(ns["f"])(1) == 2


def test_padded_sample_takes_runs_of_masked_tokens():
    """Tokens.sample on padded + mask: windows of consecutive masked tokens of the drawn rows
    (one-run rows by slicing, rows with holes through their masked columns)."""
    rng = np.random.default_rng(12)
    for _ in range(20):
        rows, width = 50, int(rng.integers(5, 60))
        a, b = -rng.random((rows, width)), -rng.random((rows, width))
        m = np.zeros((rows, width), bool)
        for r in range(rows):
            t0, t1 = sorted(rng.integers(0, width + 1, 2))
            m[r, t0:t1] = True
            if r % 3 == 0 and t1 - t0 > 2:
                m[r, rng.integers(t0 + 1, t1 - 1)] = False
        m[0, 0] = True
        tok = gap.normalize(a, b, m)
        if tok.n <= 200:
            continue
        sa, sb = tok.sample(200, runs=16)
        r2 = np.random.default_rng(0)                    # the draws sample() makes (seed 0)
        drawn = np.searchsorted(tok.cu, r2.integers(0, tok.n, 16), side="right") - 1
        lens = tok.lengths[drawn]
        s0 = r2.integers(0, np.maximum(lens - 12, 0) + 1)
        take = np.minimum(lens, 12)
        cols = [np.flatnonzero(m[r])[s:s + t] for r, s, t in zip(drawn, s0, take)]
        np.testing.assert_array_equal(sa, np.concatenate([a[r][c] for r, c in zip(drawn, cols)]))
        np.testing.assert_array_equal(sb, np.concatenate([b[r][c] for r, c in zip(drawn, cols)]))


def test_messages_show_the_values_themselves():
    """No numpy reprs (``np.float64(0.5)``) and no wrapped integers in the one-line errors."""
    x = np.array([-1.0, -1.0, -1.0])
    e = _err(measure, x, x, mask=np.array([1, 0.5, 1]))
    assert (e.field, e.index) == ("mask", 1) and "value 0.5," in str(e) and "np." not in str(e)
    e = _err(measure, x, x, cu_seqlens=np.array([0, 2 ** 63 + 5, 3], np.uint64))
    assert (e.field, e.index) == ("cu_seqlens", 1) and str(2 ** 63 + 5) in str(e)


@pytest.mark.parametrize("path", ["reference", "fast"])
def test_differences_whose_sum_overflows_are_refused_on_both_paths(path):
    """Finite float64 logprobs near -1.7e308: |d| sums to inf. Both paths say so (the
    reference used to return inf statistics with warnings while the fast pass refused)."""
    t = np.full(10, -1.7e308)
    e = _err(measure, t, np.zeros(10), _path=path)
    assert e.field == "rollout_logprobs" and "overflows" in str(e)
