"""CPU attention over a right-padded batch (kv_lens): each sequence gets the bits it gets alone."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from skyrl_numerics.errors import InputError
from skyrl_numerics.kernels import attention


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(1, 150), min_size=1, max_size=5), Sq=st.integers(1, 3),
       seed=st.integers(0, 1000))
def test_padded_batch_equals_each_alone(lens, Sq, seed):
    g = torch.Generator().manual_seed(seed)
    lens = [max(n, Sq) for n in lens]
    H, Hkv, D, L = 4, 2, 16, max(lens)
    q = torch.randn(len(lens), H, Sq, D, generator=g).bfloat16()
    k = torch.zeros(len(lens), Hkv, L, D).bfloat16()
    v = torch.zeros(len(lens), Hkv, L, D).bfloat16()
    for b, n in enumerate(lens):
        k[b, :, :n] = torch.randn(Hkv, n, D, generator=g).bfloat16()
        v[b, :, :n] = torch.randn(Hkv, n, D, generator=g).bfloat16()
    out = attention(q, k, v, kv_lens=torch.tensor(lens), backend="cpu")
    for b, n in enumerate(lens):
        alone = attention(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], backend="cpu")
        assert torch.equal(out[b:b + 1], alone), (b, n)


def test_kv_lens_errors():
    q = torch.zeros(2, 2, 3, 16)
    k = torch.zeros(2, 2, 10, 16)
    with pytest.raises(InputError, match="kv_lens"):
        attention(q, k, k, kv_lens=torch.tensor([2, 10]), backend="cpu")   # 2 < Sq
    with pytest.raises(InputError, match="kv_lens"):
        attention(q, k, k, kv_lens=torch.tensor([5, 5]), backend="reference")
