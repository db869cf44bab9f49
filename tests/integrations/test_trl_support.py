"""Sampler-support replay in TRL 1.16's GRPO loss (``integrations.trl_support``).

With TRL's own code (one child process, ``trl_support_child.py``; supports from the session
engine ``vllm_qwen``, top-p 0.9 / top-k 64): the replayed logprobs equal our trainer's support
path bit for bit, the gap to the engine's logprobs shrinks against TRL's full-vocabulary ones,
TRL's ``_compute_loss`` gradient is the support path's, the supports survive TRL's own
shuffle/split with their rows, and bad supports raise InputError through TRL's loss.

Here, without TRL: the padded-tensor converters (a property over random supports and row
permutations, as TRL's shuffle/split index rows) and every refusal naming the field and row.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from framework_paths import framework_dir
from skyrl_numerics.errors import InputError
from skyrl_numerics.integrations.trl_support import SUPPORT_KEY, packed_support, support_tensor
from skyrl_numerics.replay import PackedSupport

CHILD = Path(__file__).with_name("trl_support_child.py")
V = 40


@pytest.fixture(scope="module")
def out(vllm_qwen, tmp_path_factory) -> dict:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 6, 2, 5)]
    roll = vllm_qwen.generate(prompts, temperature=1.0, top_p=0.9, top_k=64, max_tokens=8,
                              capture_support=True, seed=11)
    path = roll.save(tmp_path_factory.mktemp("trl_support") / "rollout.safetensors")
    env = dict(os.environ)      # as conftest.py's trl_env (module scope: one child for the file)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(framework_dir("trl")), env.get("PYTHONPATH")) if p)
    res = subprocess.run([sys.executable, str(CHILD), str(path)], env=env, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.vllm
def test_replayed_logprobs_are_our_support_path_bitwise(out):
    lp = out["logps"]
    assert lp["valid"] == out["tokens"] == 32 and out["support_sizes"][2] < 512, out
    assert lp["add_support_vs_ours_differing"] == 0 and lp["mixin_vs_ours_differing"] == 0, lp
    assert lp["stock_vs_ours_differing"] == lp["valid"] and lp["entropy_finite"], lp   # replay changed every token


@pytest.mark.slow
@pytest.mark.vllm
def test_gap_to_the_engine_shrinks(out):
    g = out["gap"]
    # full vocabulary: off by log p(S) on every token (~log 0.25 here); replayed: the engine's MoE
    # numerics only (no R3), a fraction of it
    assert g["full_vocab_mean"] > 0.5 and g["replayed_mean"] < g["full_vocab_mean"] / 20, g
    assert g["replayed_max"] < g["full_vocab_max"] and g["ratio_dev_replayed"] < g["ratio_dev_full"] / 20, g
    assert g["logged"]["gap/replayed_mean_abs"] == pytest.approx(g["replayed_mean"], rel=1e-6)
    assert g["logged"]["gap/full_vocab_mean_abs"] == pytest.approx(g["full_vocab_mean"], rel=1e-6)


@pytest.mark.slow
@pytest.mark.vllm
def test_trls_loss_backward_is_the_support_paths(out):
    r = out["grad"]
    assert r["nonzero"] and r["max_abs_diff_vs_support_path"] == 0.0, r
    assert r["max_abs_diff_vs_stock"] > 0.1, r


@pytest.mark.slow
@pytest.mark.vllm
def test_supports_survive_trls_shuffle_and_split(out):
    r = out["shuffle_split"]
    assert r == {"parts": 12, "support_rows_differing": 0, "logps_differing": 0}, r


@pytest.mark.slow
@pytest.mark.vllm
def test_bad_supports_raise_through_trls_loss(out):
    e = out["errors"]
    b, j = e["last_valid"]
    assert e["shape"] is not None and f"field '{SUPPORT_KEY}'" in e["shape"] and "[B, C, K]" in e["shape"], e
    assert e["out_of_vocab"] is not None and e["out_of_vocab"].startswith(f"row {b}, field '{SUPPORT_KEY}', index {j}"), e
    assert "1000000 outside the vocabulary [0, 512)" in e["out_of_vocab"], e
    assert e["not_own_token"] is not None and f"row {b}" in e["not_own_token"], e
    assert "not in its own support" in e["not_own_token"], e


@pytest.mark.slow
@pytest.mark.vllm
def test_reference_model_and_aux_loss(out):
    """``beta != 0``: TRL's reference logprobs are replayed too (same weights: the policy's bits,
    where TRL's full-vocabulary ones differ on every token); the MoE aux loss is TRL's own."""
    r = out["ref_and_aux"]
    assert r["has_ref_model"] and r["aux_enabled"] and r["ref_vs_old_differing"] == 0, r
    assert r["aux_bitwise"] and r["aux_trl"] > 0 and r["loss_finite"], r


# ---- without TRL: the converters ----------------------------------------------------------------

@st.composite
def batches(draw):
    b, c = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    lens = draw(st.lists(st.integers(0, c), min_size=b, max_size=b))
    mask = (torch.arange(c)[None, :] < torch.tensor(lens)[:, None]).long()
    sets = [sorted(draw(st.sets(st.integers(0, V - 1), min_size=1, max_size=8))) for _ in range(sum(lens))]
    targets = [draw(st.sampled_from(s)) for s in sets]
    ids = torch.zeros(b, c, dtype=torch.long)
    ids[mask.bool()] = torch.tensor(targets, dtype=torch.long)
    perm = torch.from_numpy(np.asarray(draw(st.permutations(range(b)))))
    return PackedSupport.from_sets(sets, V), ids, mask, perm


@given(batches())
def test_converters_round_trip_under_row_permutations(case):
    """support_tensor -> packed_support is the identity, and a row permutation of the padded
    tensor (what TRL's shuffle does to every batch tensor) gives the permuted rows' supports."""
    ps, ids, mask, perm = case
    t = support_tensor(ps, mask)
    assert t.shape[:2] == ids.shape and t.dtype == torch.int32
    assert packed_support(t, ids, mask, V) == ps
    shuffled = packed_support(t[perm], ids[perm], mask[perm], V)
    first = np.concatenate([[0], mask.sum(1).cumsum(0).numpy()])
    rows = [ps.row(k) for i in perm.tolist() for k in range(first[i], first[i + 1])]
    assert shuffled == PackedSupport.from_sets([r.tolist() for r in rows], V)


def test_unsorted_padded_rows_are_accepted():
    t = torch.tensor([[[7, -1, 3], [-1, 5, -1]]])
    p = packed_support(t, torch.tensor([[3, 5]]), torch.tensor([[1, 1]]), V)
    assert p == PackedSupport.from_sets([[3, 7], [5]], V)


def _bad(t, ids=None, mask=None):
    ids = torch.tensor([[3, 5, 0], [1, 2, 9]]) if ids is None else ids
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]]) if mask is None else mask
    with pytest.raises(InputError) as e:
        packed_support(t, ids, mask, V)
    return str(e.value)


GOOD = torch.tensor([[[3, 4], [5, -1], [-1, -1]], [[1, -1], [2, 6], [9, 10]]])


@pytest.mark.parametrize("t, msg", [
    (GOOD[:, :2], f"field '{SUPPORT_KEY}': expected [B, C, K] = [2, 3, K>=1] (the completions' shape), got (2, 2, 2)"),
    (GOOD[..., 0], f"field '{SUPPORT_KEY}': expected [B, C, K] = [2, 3, K>=1] (the completions' shape), got (2, 3)"),
    (GOOD.float(), f"field '{SUPPORT_KEY}': expected integer token ids, got torch.float32"),
])
def test_wrong_shape_or_dtype(t, msg):
    assert _bad(t) == msg


@pytest.mark.parametrize("row, col, k, value, msg", [
    (1, 2, 1, V, f"token id {V} outside the vocabulary [0, {V}) (-1 pads)"),
    (1, 1, 0, -2, f"token id -2 outside the vocabulary [0, {V}) (-1 pads)"),
    (1, 2, 0, -1, "the completion token is not in its own support (token 9)"),
    (0, 1, 1, 5, "a token id repeated (token 5)"),
])
def test_bad_rows_are_named(row, col, k, value, msg):
    t = GOOD.clone()
    t[row, col, k] = value
    assert _bad(t) == f"row {row}, field '{SUPPORT_KEY}', index {col}: {msg}"


def test_empty_support_and_padding_rows():
    t = GOOD.clone()
    t[0, 2] = torch.tensor([V + 3, -7])          # a padding position: never read
    packed_support(t, torch.tensor([[3, 5, 0], [1, 2, 9]]), torch.tensor([[1, 1, 0], [1, 1, 1]]), V)
    t[1, 0] = -1
    assert _bad(t).startswith(f"row 1, field '{SUPPORT_KEY}', index 0: an empty support")


def test_support_tensor_counts_rows():
    with pytest.raises(InputError, match=f"field '{SUPPORT_KEY}': 2 support rows for 3 completion tokens"):
        support_tensor(PackedSupport.from_sets([[1], [2]], V), torch.tensor([[1, 1, 1]]))
