"""The grouped MoE layer's data movement (``kernels/csrc/moe_rows.c`` through
:mod:`skyrl_numerics.kernels.cpu_moe`): the sort of the (token, slot) pairs by expert is torch's
stable sort and the slot-order weighted combine equal
their torch specifications bit for bit."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from skyrl_numerics.kernels import cpu_moe, native

pytestmark = pytest.mark.isa   # also run under each lower CPU capability (tests/test_isa_matrix.py)


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


needs_lib = pytest.mark.skipif(native.lib() is None, reason="compiled kernels unavailable")


@settings(max_examples=40, deadline=None)
@given(T=st.integers(0, 60), k=st.integers(1, 8), E=st.integers(1, 130), skew=st.booleans(),
       native_on=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_sort_pairs_is_torchs_stable_sort(T, k, E, skew, native_on, seed):
    """The pairs p = t k + s ordered as torch.sort(stable=True) orders the flat ids (the C
    counting sort and its numpy spec alike): offsets per expert, the token of each sorted row,
    and each pair's sorted row."""
    if native_on and native.lib() is None:
        pytest.skip(f"compiled kernels unavailable: {native.unavailable_reason()}")
    g = torch.Generator().manual_seed(seed)
    hi = min(E, 3) if skew else E             # skew: a few experts take every pair (ties)
    ids = torch.randint(0, hi, (T, k), generator=g)
    with pytest.MonkeyPatch.context() as mp:
        if not native_on:
            mp.setattr(cpu_moe, "lib", lambda: None)
        off, src, rowmap = cpu_moe.sort_pairs(ids, E)
    order = torch.sort(ids.reshape(-1), stable=True).indices.numpy()
    counts = torch.bincount(ids.reshape(-1), minlength=E).numpy()
    assert off.dtype == src.dtype == rowmap.dtype == np.int64
    assert np.array_equal(off, np.concatenate([[0], np.cumsum(counts)]))
    assert np.array_equal(src, order // k)
    assert np.array_equal(rowmap[order], np.arange(T * k))


@pytest.mark.parametrize("native_on", [True, False])
def test_sort_pairs_refuses_an_id_outside_the_experts(native_on, monkeypatch):
    if native_on and native.lib() is None:
        pytest.skip(f"compiled kernels unavailable: {native.unavailable_reason()}")
    if not native_on:
        monkeypatch.setattr(cpu_moe, "lib", lambda: None)
    for bad in (8, -1):
        ids = torch.tensor([[0, 3], [bad, 1]])
        with pytest.raises(ValueError, match=str(bad) if native_on or bad > 0 else "negative"):
            cpu_moe.sort_pairs(ids, 8)


@needs_lib
@settings(max_examples=30, deadline=None)
@given(T=st.integers(1, 40), k=st.integers(1, 8), H=st.sampled_from([1, 8, 100, 256]),
       scale=st.sampled_from([1e-3, 1.0, 1e4]), seed=st.integers(0, 2 ** 16))
def test_combine_equals_its_specification(T, k, H, scale, seed):
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    rows = T * k + 5
    y = torch.randn(rows, H + 16, generator=g) * scale                   # padded columns
    rowmap = rng.permutation(rows)[:T * k]
    w = torch.softmax(torch.randn(T, k, generator=g), -1)
    got = cpu_moe.combine(y, rowmap, w, H, torch.bfloat16)
    want = cpu_moe.combine_spec(y, rowmap, w, H, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (T, H)
    assert torch.equal(_bits(got), _bits(want))


@needs_lib
def test_indices_outside_their_arrays_are_refused_by_name():
    """Nothing is read or written out of bounds: a bad index is a ValueError naming it."""
    y = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"rowmap\[1\] = 4 is outside 0 .. 3"):
        cpu_moe.combine(y, np.array([0, 4]), torch.tensor([[0.5, 0.5]]), 8, torch.bfloat16)


def test_without_the_library_the_specifications_run(monkeypatch):
    monkeypatch.setattr(cpu_moe, "lib", lambda: None)
    y = torch.randn(4, 8)
    out = cpu_moe.combine(y, np.array([3, 1]), torch.tensor([[0.25, 0.75]]), 8, torch.bfloat16)
    w = torch.tensor([0.25, 0.75]).bfloat16()
    assert torch.equal(out[0], y[3].bfloat16() * w[0] + y[1].bfloat16() * w[1])
