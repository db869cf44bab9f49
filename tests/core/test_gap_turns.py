"""gap.measure per turn (issue 28): per-turn rows against a float64 numpy reference computed turn
by turn here (outside the library's passes), layouts, the fast pass, JSON, errors, `gap FILE`."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skyrl_numerics.cli import main
from skyrl_numerics.errors import InputError
from skyrl_numerics.gap import FAST_MIN_TOKENS, GapReport, measure
from skyrl_numerics.rollout import Rollout

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TAUS = (1.5, 2.0, 5.0)


def numpy_turn_rows(a, b, mask, turns, cu):
    """The per-turn figures, turn by turn, in plain float64 numpy."""
    rows = []
    row_of = np.repeat(np.arange(len(cu) - 1), np.diff(cu))
    for k in np.unique(turns[mask]):
        sel = mask & (turns == k)
        x, y = a[sel], b[sel]
        d = x.astype(np.float64) - y.astype(np.float64)
        ad = np.abs(d)
        row = {"turn": int(k), "n_tokens": int(sel.sum()), "n_seqs": int(np.unique(row_of[sel]).size),
               "mean_abs": ad.mean(), "max_abs": ad.max(), "frac_bitwise_equal": float(np.mean(x == y)),
               "kl_k1": np.mean(-d), "kl_k2": np.mean(d * d / 2), "kl_k3": np.mean(np.expm1(d) - d),
               "p50_abs": np.quantile(ad, 0.5), "p99_abs": np.quantile(ad, 0.99)}
        row.update({f"F_{t:g}": float(np.mean(ad > math.log(t))) for t in TAUS})
        rows.append(row)
    return rows


def check_rows(rep: GapReport, ref: list, rel: float):
    assert [r["turn"] for r in rep.per_turn] == [r["turn"] for r in ref]
    for got, want in zip(rep.per_turn, ref):
        for k, v in want.items():
            if k in ("turn", "n_tokens", "n_seqs") or k.startswith("F_") or k in ("max_abs", "frac_bitwise_equal"):
                assert got[k] == v, (got["turn"], k)          # counts and max: exact
            else:
                assert got[k] == pytest.approx(v, rel=rel, abs=1e-300), (got["turn"], k)


def test_hand_vector():
    # seq 0: d = [0, -0.5, (obs), 0.25] turns [0, 0, 1, 1]; seq 1: d = [-1, 0] turns [0, 1]
    a = np.array([-1, -2, np.nan, -0.5, -3, -0.125], np.float32)
    b = np.array([-1, -1.5, np.nan, -0.75, -2, -0.125], np.float32)
    m = np.array([1, 1, 0, 1, 1, 1], bool)
    t = np.array([0, 0, 1, 1, 0, 1])
    for path in ("reference", "fast"):
        rep = measure(a, b, m, cu_seqlens=[0, 4, 6], turns=t, _path=path)
        r0, r1 = rep.per_turn
        assert (r0["turn"], r0["n_tokens"], r0["n_seqs"], r1["n_tokens"], r1["n_seqs"]) == (0, 3, 2, 2, 2)
        assert r0["mean_abs"] == 0.5 and r0["max_abs"] == 1.0 and r0["frac_bitwise_equal"] == 1 / 3
        assert r0["kl_k1"] == 0.5 and r0["kl_k2"] == pytest.approx((0.25 + 1) / 2 / 3, rel=1e-15)
        assert r1["mean_abs"] == 0.125 and r1["kl_k1"] == -0.125 and r1["frac_bitwise_equal"] == 0.5
        assert (r0["F_1.5"], r0["F_2"], r1["F_1.5"]) == (2 / 3, 1 / 3, 0.0)
        s = rep.summary()
        assert s["turn_1/mean_abs"] == 0.125 and s["turn_0/n_tokens"] == 3 and s["turn_0/F_2"] == 1 / 3
        assert s["n_tokens"] == 5 and s["mean_abs"] == pytest.approx(0.35)       # the whole, unchanged


@st.composite
def batches(draw, max_seqs=6, max_turns=4):
    """Flat multi-turn batch: per row, turns of 0..3 observation then 1..4 model tokens; NaN
    (never read) at observations; dtypes float32/float64; some exact ties."""
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    lens, mask, turns = [], [], []
    for _ in range(draw(st.integers(1, max_seqs))):
        n = 0
        for k in range(draw(st.integers(1, max_turns))):
            o, md = int(rng.integers(0, 4)), int(rng.integers(1, 5))
            mask += [False] * o + [True] * md
            turns += [k] * (o + md)
            n += o + md
        lens.append(n)
    mask, turns = np.array(mask), np.array(turns, np.int32)
    dt = draw(st.sampled_from([np.float32, np.float64]))
    scale = draw(st.sampled_from([1e-4, 1e-2, 0.5, 3.0]))
    b = -rng.random(mask.size) * 5
    a = np.minimum(b + rng.normal(0, scale, mask.size), 0)
    tie = rng.random(mask.size) < 0.3
    a[tie] = b[tie]
    a, b = a.astype(dt), b.astype(dt)
    a[~mask], b[~mask] = np.nan, np.nan
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    return a, b, mask, turns, cu


@SETTINGS
@given(batches())
def test_per_turn_matches_numpy_reference(batch):
    a, b, m, t, cu = batch
    ref = numpy_turn_rows(a, b, m, t, cu)
    for path in ("reference", "fast"):
        check_rows(measure(a, b, m, cu_seqlens=cu, turns=t, _path=path), ref, 1e-9)


@SETTINGS
@given(batches())
def test_padded_and_ragged_give_the_flat_rows(batch):
    a, b, m, t, cu = batch
    flat = measure(a, b, m, cu_seqlens=cu, turns=t)
    seqs = [slice(cu[i], cu[i + 1]) for i in range(len(cu) - 1)]
    ragged = measure([a[s] for s in seqs], [b[s] for s in seqs], [m[s] for s in seqs],
                     turns=[t[s] for s in seqs])
    W = int(np.diff(cu).max()) + 3
    pa, pb = np.full((len(seqs), W), np.nan), np.full((len(seqs), W), np.nan)
    pm, pt = np.zeros((len(seqs), W), bool), np.full((len(seqs), W), -7)   # padding: garbage turns
    for i, s in enumerate(seqs):
        L = s.stop - s.start
        pa[i, 1:1 + L], pb[i, 1:1 + L], pm[i, 1:1 + L], pt[i, 1:1 + L] = a[s], b[s], m[s], t[s]
    padded = measure(pa.astype(a.dtype), pb.astype(b.dtype), pm, turns=pt)
    assert ragged == flat and padded.per_turn == flat.per_turn


@pytest.mark.parametrize("kernel", ["numba", "numpy"])
def test_large_turns_take_the_fast_pass(kernel, monkeypatch):
    """A turn above FAST_MIN_TOKENS tokens goes through the fast scan (spied), same figures."""
    rng = np.random.default_rng(3)
    B, L = 80, 6000                        # 480K tokens; turn 0: 4000 per row (320K), turn 1: 1500 (+ obs)
    t = np.tile(np.r_[np.zeros(4000), np.ones(2000)], B).astype(np.int32)
    m = np.tile(np.r_[np.ones(4000), np.zeros(500), np.ones(1500)], B).astype(bool)
    b = (-rng.random(B * L) * 4).astype(np.float32)
    a = np.minimum(b + rng.normal(0, 1e-3, B * L).astype(np.float32), 0).astype(np.float32)
    a[::7] = b[::7]
    a[~m] = np.nan
    cu = np.arange(B + 1) * L
    from skyrl_numerics import gap
    calls = []
    real = gap.fast_stats

    def spy(tok, *args, **kw):
        calls.append(tok.n)
        return real(tok, *args, **kw)
    monkeypatch.setattr(gap, "fast_stats", spy)
    rep = measure(a, b, m, cu_seqlens=cu, turns=t, _kernel=kernel)
    assert 4000 * B > FAST_MIN_TOKENS and calls == [int(m.sum()), 4000 * B]   # whole, then turn 0
    check_rows(rep, numpy_turn_rows(a, b, m, t, cu), 1e-9)


def test_no_turns_no_rows_and_single_turn_row_is_the_whole():
    a, b = np.array([-1.0, -2.0, -0.5]), np.array([-1.0, -1.5, -0.75])
    rep = measure(a, b)
    assert rep.per_turn == [] and "per_turn" not in rep.to_dict()
    assert not any(k.startswith("turn") for k in rep.summary())
    one = measure(a, b, turns=np.zeros(3, np.int64))
    assert len(one.per_turn) == 1
    assert {k: v for k, v in one.per_turn[0].items() if k != "turn"} == rep.summary()


def test_json_round_trip_with_turns():
    a = np.array([-1, -2, -0.5, -3, -0.125])
    b = np.array([-1, -1.5, -0.75, -2, -0.125])
    rep = measure(a, b, cu_seqlens=[0, 3, 5], turns=[0, 1, 1, 0, 2])
    d = json.loads(json.dumps(rep.to_dict()))
    assert [r["turn"] for r in d["per_turn"]] == [0, 1, 2]
    assert GapReport.from_dict(d) == rep
    assert json.loads(json.dumps(rep.summary()))["turn_2/n_tokens"] == 1


def test_turn_errors_name_row_and_index():
    a, b = np.array([-1.0, -2.0, -0.5, -3.0]), np.array([-1.0, -1.5, -0.75, -2.0])
    m = np.array([1, 0, 1, 1], bool)
    with pytest.raises(InputError) as e:       # negative at a measured token: row 1, index 0
        measure(a, b, m, cu_seqlens=[0, 2, 4], turns=[0, 0, -1, 0])
    assert (e.value.field, e.value.row, e.value.index) == ("turns", 1, 0), str(e.value)
    measure(a, b, m, cu_seqlens=[0, 2, 4], turns=[0, -1, 0, 0])          # unmasked: never read
    for bad in (np.zeros(4), np.zeros(4, bool), np.zeros(3, np.int64), [[0, 0], [0, 0]]):
        with pytest.raises(InputError) as e:
            measure(a, b, m, cu_seqlens=[0, 2, 4], turns=bad)
        assert e.value.field == "turns", str(e.value)
    with pytest.raises(InputError) as e:
        measure([a[:2], a[2:]], [b[:2], b[2:]], turns=[np.zeros(2, int)])
    assert e.value.field == "turns"
    with pytest.raises(InputError) as e:
        measure([a[:2], a[2:]], [b[:2], b[2:]], turns=[np.zeros(2, int), np.zeros(3, int)])
    assert (e.value.field, e.value.row) == ("turns", 1)


# ---- a multi-turn rollout file through measure and `skyrl-numerics gap FILE` --------------------
def _multi_turn_rollout():
    rng = np.random.default_rng(0)
    prompts, responses, lps, tls, masks, turns = [], [], [], [], [], []
    for i in range(4):
        m, t = [], []
        for k in range(3):
            o, n = (0 if k == 0 else 2), 3 + i
            m += [False] * o + [True] * n
            t += [k] * (o + n)
        lp = (-rng.random(len(m)) * 3).astype(np.float32)
        tl = np.minimum(lp + rng.normal(0, 1e-2, len(m)).astype(np.float32), 0)
        prompts.append([1, 2])
        responses.append(rng.integers(0, 100, len(m)).tolist())
        lps.append([float(x) if mm else None for x, mm in zip(lp, m)])
        tls.append([float(x) if mm else None for x, mm in zip(tl, m)])
        masks.append(m)
        turns.append(t)
    return Rollout.from_lists(prompts, responses, lps, trainer_logprobs=tls, loss_mask=masks, turns=turns,
                              engine="vllm (cpu)", engine_version="0.32.0")


def test_rollout_measure_per_turn_matches_numpy():
    ro = _multi_turn_rollout()
    rep = measure(ro.trainer_logprobs, ro.rollout_logprobs, ro.loss_mask, cu_seqlens=ro.response_cu,
                  turns=ro.turns)
    check_rows(rep, numpy_turn_rows(ro.trainer_logprobs, ro.rollout_logprobs, ro.loss_mask, ro.turns,
                                    ro.response_cu), 1e-12)
    assert rep.n_tokens == int(ro.loss_mask.sum())


@pytest.mark.parametrize("suffix", [".jsonl", ".safetensors"])
def test_gap_cli_prints_a_per_turn_table(tmp_path, suffix, capsys):
    ro = _multi_turn_rollout()
    f = ro.save(tmp_path / f"mt{suffix}")
    out = tmp_path / "out"
    assert main(["gap", str(f), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "per turn" in printed and "turn 2" in printed, printed
    rep = json.loads((out / "report.json").read_text())
    assert rep["summary"]["n_tokens"] == int(ro.loss_mask.sum())
    assert [r["turn"] for r in rep["report"]["per_turn"]] == [0, 1, 2]
    assert rep["summary"]["turn_1/n_tokens"] == sum(3 + i for i in range(4))
    ref = numpy_turn_rows(ro.trainer_logprobs, ro.rollout_logprobs, ro.loss_mask, ro.turns, ro.response_cu)
    for got, want in zip(rep["report"]["per_turn"], ref):
        assert got["mean_abs"] == pytest.approx(want["mean_abs"], rel=1e-12)


def test_gap_cli_single_turn_file_has_no_turn_table(tmp_path, capsys):
    ro = Rollout.from_lists([[1]], [[2, 3]], [[-1.0, -0.5]], trainer_logprobs=[[-1.0, -0.25]])
    assert main(["gap", str(ro.save(tmp_path / "one.jsonl")), "--out", str(tmp_path / "o")]) == 0
    assert "per turn" not in capsys.readouterr().out
    assert "per_turn" not in json.loads((tmp_path / "o" / "report.json").read_text())["report"]
