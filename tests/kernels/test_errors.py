"""Bad input -> InputError naming the field and what was expected."""
import pytest
import torch

from skyrl_numerics.errors import InputError
from skyrl_numerics.kernels import attention, grouped_matmul, matmul, mean, rms_norm, token_logprob_entropy


def test_matmul_shape_and_dtype():
    with pytest.raises(InputError, match="field 'b'.*K"):
        matmul(torch.randn(3, 4), torch.randn(5, 2))
    with pytest.raises(InputError, match="field 'b'.*dtype"):
        matmul(torch.randn(3, 4), torch.randn(4, 2).double())
    with pytest.raises(InputError, match="field 'a'"):
        matmul(torch.ones(3, 4, dtype=torch.int64), torch.randn(4, 2))
    with pytest.raises(InputError, match="field 'backend'"):
        matmul(torch.randn(3, 4), torch.randn(4, 2), backend="gpu")


def test_grouped_offsets():
    x, w = torch.randn(5, 4), torch.randn(3, 4, 3)
    with pytest.raises(InputError, match="field 'offsets'.*end at T=5"):
        grouped_matmul(x, w, torch.tensor([0, 2, 4, 4]))
    with pytest.raises(InputError, match="field 'offsets', index 2.*non-decreasing"):
        grouped_matmul(x, w, torch.tensor([0, 4, 3, 5]))
    with pytest.raises(InputError, match="expected shape \\(4,\\)"):
        grouped_matmul(x, w, torch.tensor([0, 5]))


def test_token_and_norm_and_attention_errors():
    with pytest.raises(InputError, match="token id 9 outside vocab"):
        token_logprob_entropy(torch.randn(2, 9), torch.tensor([0, 9]))
    with pytest.raises(InputError, match="field 'temperature'"):
        token_logprob_entropy(torch.randn(2, 9), torch.tensor([0, 1]), 0.0)
    with pytest.raises(InputError, match="field 'weight'"):
        rms_norm(torch.randn(2, 8), torch.randn(7))
    with pytest.raises(InputError, match="field 'dim', index 0"):
        mean(torch.randn(2, 8), 2)
    with pytest.raises(InputError, match="multiple of kv heads"):
        attention(torch.randn(1, 3, 4, 16), torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16))
    with pytest.raises(InputError, match="more queries"):
        attention(torch.randn(1, 2, 5, 16), torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16))
