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



def test_conftests_leave_the_environment_and_threads_alone():
    """Importing the test conftests changes neither the environment (no TRITON_INTERPRET: it would
    leak into every later test and into vLLM workers) nor torch's thread count."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    code = (
        "import os, runpy, sys, torch\n"
        f"sys.path.insert(0, {str(tests)!r})\n"
        "env, threads = dict(os.environ), torch.get_num_threads()\n"
        f"for p in {[str(tests / d / 'conftest.py') for d in ('kernels', 'quant')]!r}:\n"
        "    runpy.run_path(p)\n"
        "assert dict(os.environ) == env, set(os.environ.items()) ^ set(env.items())\n"
        "assert torch.get_num_threads() == threads\n"
        "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(InputError, match="TRITON_INTERPRET=1"):
        matmul(torch.randn(3, 4), torch.randn(4, 2), backend="triton")
