"""PackedSupport and support_logprobs against the dense boolean-mask reference."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from skyrl_numerics.errors import InputError
from skyrl_numerics.replay import PackedSupport, support_logprobs, support_logprobs_reference
from support_tol import float32_tolerance


def _case(seed, n=7, H=16, V=50, max_k=12, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    hidden = torch.randn(n, H, generator=g, dtype=dtype)
    W = torch.randn(V, H, generator=g, dtype=dtype)
    sets = [rng.choice(V, size=rng.integers(1, max_k + 1), replace=False) for _ in range(n)]
    targets = torch.tensor([int(rng.choice(s)) for s in sets])
    return hidden, W, targets, PackedSupport.from_sets(sets, V)


# ---- PackedSupport ----------------------------------------------------------------------------------
def test_csr_layout_and_arrays_roundtrip(tmp_path):
    s = PackedSupport.from_sets([[5, 1, 3], [7], [0, 9]], vocab_size=10)
    assert s.token_ids.dtype == np.int32 and s.offsets.dtype == np.int64
    assert s.token_ids.tolist() == [1, 3, 5, 7, 0, 9] and s.offsets.tolist() == [0, 3, 4, 6]
    assert np.shares_memory(s.row(2), s.token_ids) and s.row(2).tolist() == [0, 9]
    assert s.contains(np.array([3, 7, 1])).tolist() == [True, True, False]
    assert PackedSupport.from_arrays(s.to_arrays()) == s
    from safetensors.numpy import load_file, save_file

    save_file({f"support.{k}": v for k, v in s.to_arrays().items()}, str(tmp_path / "s.safetensors"))
    d = {k.split(".", 1)[1]: v for k, v in load_file(str(tmp_path / "s.safetensors")).items()}
    back = PackedSupport.from_arrays(d)
    assert back == s and back.vocab_size == 10


def test_support_errors():
    with pytest.raises(InputError, match="duplicate token id 3"):
        PackedSupport.from_sets([[3, 3]])
    with pytest.raises(InputError, match="token id 10 >= vocab_size 10 \\(token 1\\)"):
        PackedSupport.from_sets([[1], [10]], vocab_size=10)
    with pytest.raises(InputError, match="strictly increasing") as e:
        PackedSupport(np.array([1, 4, 2]), np.array([0, 3]))
    assert e.value.index == 2
    with pytest.raises(InputError, match="empty support") as e:
        PackedSupport(np.array([1, 2]), np.array([0, 2, 2]))
    assert e.value.index == 1
    with pytest.raises(InputError, match="last offset 3 != number of ids 2"):
        PackedSupport(np.array([1, 2]), np.array([0, 3]))


class _LP:  # the shape of vLLM's Logprob objects
    def __init__(self, logprob):
        self.logprob = logprob


def test_from_topk_logprobs():
    ninf = -math.inf
    rows = [{4: _LP(-0.1), 9: _LP(-2.4), 2: _LP(ninf)},   # top-2 support among 3 returned
            {7: -0.5, 1: -1.0, 3: ninf}]                    # plain floats too
    s = PackedSupport.from_topk_logprobs(rows, requested=3)
    assert s.row(0).tolist() == [4, 9] and s.row(1).tolist() == [1, 7]
    with pytest.raises(InputError, match="support may be larger") as e:
        PackedSupport.from_topk_logprobs([{1: -0.1, 2: -3.0}], requested=2)
    assert e.value.index == 0
    with pytest.raises(InputError, match="empty support"):
        PackedSupport.from_topk_logprobs([{1: ninf}])


# ---- support_logprobs -------------------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2 ** 31), st.integers(1, 64), st.integers(1, 9), st.sampled_from(["dense", "sparse", "auto"]))
def test_matches_dense_reference(seed, chunk, n, method):
    hidden, W, targets, sup = _case(seed, n=n)
    lp, ent = support_logprobs(hidden, W, targets, sup, chunk=chunk, method=method)
    rlp, rent = support_logprobs_reference(hidden, W, targets, sup)
    torch.testing.assert_close(lp, rlp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, rent, rtol=1e-5, atol=1e-5)
    assert (lp <= 1e-6).all() and (ent >= -1e-6).all()
    # entropy bounded by log |S|
    assert (ent <= torch.log(torch.tensor(sup.sizes, dtype=torch.float32)) + 1e-5).all()


def test_full_support_equals_log_softmax():
    hidden, W, targets, _ = _case(3, n=6, V=70)
    want = torch.log_softmax(hidden @ W.T, -1)
    full = PackedSupport.full(6, 70)
    for sup, method in ((None, "auto"), (full, "dense"), (full, "sparse")):
        lp, ent = support_logprobs(hidden, W, targets, sup, chunk=16, method=method)
        torch.testing.assert_close(lp, want.gather(1, targets[:, None])[:, 0], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(ent, -(want.exp() * want).sum(-1), rtol=1e-10, atol=1e-12)


def test_hand_computed():
    # one token, logits [0, log 2, log 3] over vocab 3 (H = 1, hidden = 1): support {1, 2}, target 2
    hidden = torch.ones(1, 1)
    W = torch.tensor([[0.0], [math.log(2)], [math.log(3)]])
    lp, ent = support_logprobs(hidden, W, torch.tensor([2]), PackedSupport.from_sets([[1, 2]]), chunk=1)
    assert abs(lp.item() - math.log(3 / 5)) < 1e-6
    assert abs(ent.item() - -(0.4 * math.log(0.4) + 0.6 * math.log(0.6))) < 1e-6
    # the bias a full-vocab trainer would carry: log p(S) = log(5/6)
    full, _ = support_logprobs(hidden, W, torch.tensor([2]), None)
    assert abs((lp - full).item() + math.log(5 / 6)) < 1e-6


@pytest.mark.parametrize("method", ["dense", "sparse"])
def test_gradients_match_dense_reference(method):
    hidden, W, targets, sup = _case(11, n=5, V=40, dtype=torch.float32)
    gl, ge = torch.randn(5), torch.randn(5)
    h1, w1 = hidden.clone().requires_grad_(), W.clone().requires_grad_()
    lp, ent = support_logprobs(h1, w1, targets, sup, chunk=7, method=method)
    ((lp * gl).sum() + (ent * ge).sum()).backward()
    h2, w2 = hidden.clone().requires_grad_(), W.clone().requires_grad_()
    rlp, rent = support_logprobs_reference(h2, w2, targets, sup)
    ((rlp * gl).sum() + (rent * ge).sum()).backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", ["dense", "sparse"])
def test_gradcheck_float64(method):
    hidden, W, targets, sup = _case(5, n=3, H=4, V=11, max_k=5)
    h, w = hidden.requires_grad_(), W.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: support_logprobs(a, b, targets, sup, chunk=4, method=method), (h, w))


@pytest.mark.parametrize("method", ["dense", "sparse"])
def test_bf16_inputs(method):
    hidden, W, targets, sup = _case(8, n=4, V=30, dtype=torch.bfloat16)
    lp, _ = support_logprobs(hidden, W, targets, sup, chunk=8, method=method)
    rlp, _ = support_logprobs_reference(hidden, W, targets, sup)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, rlp, rtol=1e-3, atol=1e-3)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2 ** 31), st.floats(0.25, 4.0), st.sampled_from(["dense", "sparse", "auto"]),
       st.booleans(), st.integers(1, 64))
def test_temperature_matches_float64_reference(seed, T, method, full, chunk):
    """Logits divided by T before the renormalized log-softmax: float32 against the float64 spec,
    within the float32 error bound of tests/support_tol.py; T != 1 moves the result far beyond it."""
    hidden, W, targets, sup = _case(seed, n=6, H=32, V=80, max_k=20, dtype=torch.float32)
    if full or method == "sparse":
        sup = PackedSupport.full(6, 80) if full else sup
    lp, ent = support_logprobs(hidden, W, targets, sup, chunk=chunk, method=method, temperature=T)
    rlp, rent = support_logprobs_reference(hidden.double(), W.double(), targets, sup, temperature=T)
    tol = float32_tolerance(hidden, W, [sup.row(i) for i in range(6)], T)
    assert ((lp.double() - rlp).abs() <= tol).all() and ((ent.double() - rent).abs() <= tol).all()
    plain, _ = support_logprobs_reference(hidden.double(), W.double(), targets, sup)
    if abs(T - 1) > 0.05:
        assert ((plain - rlp).abs() > 10 * tol).any()


@pytest.mark.parametrize("method", ["dense", "sparse"])
def test_temperature_gradcheck_float64(method):
    hidden, W, targets, sup = _case(5, n=3, H=4, V=11, max_k=5)
    h, w = hidden.requires_grad_(), W.requires_grad_()
    fn = lambda a, b: support_logprobs(a, b, targets, sup, chunk=4, method=method, temperature=0.6)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (h, w))


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), True, "2"])
def test_temperature_must_be_a_positive_number(bad):
    hidden, W, targets, sup = _case(1, n=4)
    with pytest.raises(InputError) as e:
        support_logprobs(hidden, W, targets, sup, temperature=bad)
    assert e.value.field == "temperature"


def test_errors():
    hidden, W, targets, sup = _case(1, n=4)
    bad = targets.clone()
    row1 = set(sup.row(1).tolist())
    bad[1] = next(v for v in range(50) if v not in row1)
    with pytest.raises(InputError, match="is not in its support") as e:
        support_logprobs(hidden, W, bad, sup)
    assert e.value.index == 1
    with pytest.raises(InputError, match="support rows for 3 tokens"):
        support_logprobs(hidden[:3], W, targets[:3], sup)
    with pytest.raises(InputError, match="outside vocab"):
        support_logprobs(hidden, W, torch.tensor([0, 0, 0, 50]), None)
    with pytest.raises(InputError, match="token id .* >= vocab_size 20"):
        support_logprobs(hidden, W[:20], torch.arange(4), PackedSupport.from_sets([[0], [1], [2, 25], [3]]))


# ---- hardening (issue 13) --------------------------------------------------------------------
from hypothesis import given, settings
from hypothesis import strategies as st


def _sup():
    return PackedSupport.from_sets([[5, 1, 3], [7], [0, 9], [2, 4, 6, 8]], vocab_size=10)


@pytest.mark.parametrize("key,value", [
    ("token_ids", np.array([1, 3, 5, 7, 0, 9, 2, 4, 6, 8], np.float32)),      # floats: not truncated
    ("token_ids", np.array([1, 3, 5, 7, 0, 9, 2, 4, 6, 8], np.int64)),        # wire dtype is int32
    ("offsets", np.array([0, 3, 4, 6, 10], np.float64)),
    ("offsets", np.array([0, 3, 4, 6, 10], np.uint64)),
    ("vocab_size", np.array([10.0])),
    ("vocab_size", np.array([10, 10])),
    ("vocab_size", np.array([0])),
    ("version", np.array([2], np.int64)),
    ("digest", np.array([7], np.uint64)),
    ("digest", np.array([7], np.int64)),
    ("extra", np.zeros(1)),
])
def test_from_arrays_strict(key, value):
    d = dict(_sup().to_arrays())
    d[key] = value
    with pytest.raises(InputError) as e:
        PackedSupport.from_arrays(d)
    assert e.value.field == key, str(e.value)


def test_from_arrays_legacy_and_edits():
    s = _sup()
    d = s.to_arrays()
    assert set(d) == {"token_ids", "offsets", "vocab_size", "version", "digest"}
    legacy = {k: d[k] for k in ("token_ids", "offsets", "vocab_size")}
    assert PackedSupport.from_arrays(legacy) == s
    edited = dict(d)
    edited["token_ids"] = d["token_ids"].copy()
    edited["token_ids"][0] = 2                                  # still valid, but not what was written
    with pytest.raises(InputError, match="digest"):
        PackedSupport.from_arrays(edited)
    edited = dict(d)
    edited["vocab_size"] = np.array([11], np.int64)
    with pytest.raises(InputError, match="digest"):
        PackedSupport.from_arrays(edited)
    with pytest.raises(InputError):
        PackedSupport(np.array([1.5]), np.array([0, 1]))
    with pytest.raises(InputError):
        PackedSupport(np.array([1]), np.array([0, 1]), vocab_size=10.5)
    with pytest.raises(InputError):
        PackedSupport(np.array([[1]]), np.array([0, 1]))


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_array_bit_flip_refused_or_identical(data):
    s = _sup()
    d = {k: v.copy() for k, v in s.to_arrays().items()}
    key = data.draw(st.sampled_from(sorted(d)))
    raw = d[key].view(np.uint8).reshape(-1)
    pos = data.draw(st.integers(0, raw.size - 1))
    raw[pos] ^= 1 << data.draw(st.integers(0, 7))
    try:
        back = PackedSupport.from_arrays(d)
    except InputError:
        return
    assert back == s and back.vocab_size == s.vocab_size
