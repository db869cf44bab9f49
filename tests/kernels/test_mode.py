"""batch_invariant_mode(): enable / restore / nesting / threads, the registration table (CPU and,
without a GPU, CUDA), and whole models.

Nothing here assumes that the stock kernels are NOT invariant (that depends on the machine's BLAS):
the mode is checked by what it registers, by which kernel a call reaches, and by what our kernels
guarantee (rows identical for any batch)."""
import threading

import pytest
import torch

from skyrl_numerics.kernels import (batch_invariant_mode, cpu, disable_batch_invariant_cpu,
                                    enable_batch_invariant_cpu, is_batch_invariant_mode_enabled)
from skyrl_numerics.kernels import mode

pytestmark = pytest.mark.isa   # also run under each lower CPU capability (tests/test_isa_matrix.py)

# what docs/kernels.md and the mode's docstring claim, for both dispatch keys
CLAIMED = {"mm", "addmm", "bmm", "mm.out", "addmm.out", "bmm.out", "_grouped_mm", "_log_softmax",
           "_log_softmax_backward_data", "_softmax", "_softmax_backward_data", "mean.dim",
           "sum.dim_IntList", "sum", "mean", "baddbmm", "baddbmm.out", "silu", "sigmoid", "gelu", "softplus", "rsqrt", "silu_backward",
           "sigmoid_backward", "gelu_backward", "softplus_backward"}
CPU_ONLY = {"_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_flash_attention_for_cpu_backward"}


def _overridden(op: str, key: str) -> bool:
    """True when the dispatcher's kernel for ``aten::op`` on ``key`` was registered by mode.py."""
    table = torch._C._dispatch_dump_table(f"aten::{op}")
    line = next((ln for ln in table.splitlines() if ln.startswith(f"{key}:")), "")
    return mode.__file__ in line


def _mm_row0_invariant(a, b):
    return torch.equal(torch.mm(a[:1], b), torch.mm(a, b)[:1])


@pytest.fixture
def count_cpu_matmul(monkeypatch):
    """Counts calls into the CPU path's GEMM (what the mode's mm/addmm/bmm kernels call)."""
    calls = []
    real = cpu.matmul_2d

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu, "matmul_2d", counted)
    return calls


def test_enable_restore_and_nesting(count_cpu_matmul):
    a, b = torch.randn(64, 256), torch.randn(256, 256)
    stock_small = torch.mm(a[:1], b)
    assert not count_cpu_matmul and not _overridden("mm", "CPU")   # stock kernel, ours not reached
    assert not is_batch_invariant_mode_enabled()
    with batch_invariant_mode():
        assert all(_overridden(op, "CPU") for op in CLAIMED)
        assert _mm_row0_invariant(a, b) and count_cpu_matmul
        assert torch.equal(torch.mm(a, b), cpu.matmul_2d(a, b))     # the CPU path's bits
        with batch_invariant_mode():
            assert is_batch_invariant_mode_enabled()
        assert is_batch_invariant_mode_enabled() and _mm_row0_invariant(a, b)
        assert _overridden("mm", "CPU")                               # the inner exit kept it
    assert not is_batch_invariant_mode_enabled()
    assert not any(_overridden(op, "CPU") for op in CLAIMED)
    n = len(count_cpu_matmul)
    assert torch.equal(torch.mm(a[:1], b), stock_small)   # stock kernel is back (same bits as before)
    assert len(count_cpu_matmul) == n
    with pytest.raises(ValueError):
        with batch_invariant_mode():
            raise ValueError("boom")
    assert not is_batch_invariant_mode_enabled() and not _overridden("mm", "CPU")
    enable_batch_invariant_cpu()
    try:
        assert _mm_row0_invariant(a, b) and _overridden("mm", "CPU")
    finally:
        disable_batch_invariant_cpu()
    assert not is_batch_invariant_mode_enabled() and not _overridden("mm", "CPU")
    with pytest.raises(RuntimeError, match="released more times"):
        disable_batch_invariant_cpu()


def test_cuda_table_registers_the_same_ops_as_cpu():
    """The CUDA key gets the same op set as the CPU key. No GPU here: the CUDA table is built
    (it imports Triton, not CUDA) and registered for the CUDA dispatch key, and the dispatcher's
    table is read back; no CUDA kernel runs. (The table's kernels run on CPU tensors under the
    interpreter in test_triton_ops.py.)"""
    assert set(mode.registered_ops("cuda")) == CLAIMED and mode.CPU_ONLY == CPU_ONLY
    assert set(mode.registered_ops("cpu")) == CLAIMED | CPU_ONLY
    assert set(mode._cuda_kernels()) == set(mode._CPU_KERNELS) - CPU_ONLY
    assert not any(_overridden(op, key) for op in CLAIMED for key in ("CPU", "CUDA"))
    lib = mode._install(cuda=True)
    try:
        missing = {key: sorted(op for op in CLAIMED | (CPU_ONLY if key == "CPU" else set())
                               if not _overridden(op, key)) for key in ("CPU", "CUDA")}
        assert missing == {"CPU": [], "CUDA": []}
        assert not any(_overridden(op, "CUDA") for op in CPU_ONLY)
    finally:
        lib._destroy()
    assert not any(_overridden(op, key) for op in CLAIMED for key in ("CPU", "CUDA"))
    # the mode itself registers CUDA exactly when CUDA is available
    with batch_invariant_mode():
        assert all(_overridden(op, "CUDA") == torch.cuda.is_available() for op in CLAIMED)
    with pytest.raises(ValueError, match="device"):
        mode.registered_ops("mps")


def test_threads_share_a_refcount():
    a, b = torch.randn(32, 64), torch.randn(64, 64)
    errors = []

    def worker():
        try:
            for _ in range(20):
                with batch_invariant_mode():
                    if not _mm_row0_invariant(a, b):
                        errors.append("not invariant inside the mode")
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert not is_batch_invariant_mode_enabled()


def _rows_equal(outs):
    return all(torch.equal(outs[bs], outs[8][:bs]) for bs in (1, 3))


def test_tiny_mlp_forward_and_input_grads():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(96, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    x = torch.randn(8, 96)

    def run():
        outs, grads = {}, {}
        for bs in (1, 3, 8):
            xi = x[:bs].clone().requires_grad_()
            y = torch.log_softmax(mlp(xi), -1)
            y[:, 0].sum().backward()
            outs[bs], grads[bs] = y.detach(), xi.grad
        return outs, grads

    stock, _ = run()
    with batch_invariant_mode():
        outs, grads = run()
    assert _rows_equal(outs) and _rows_equal(grads)
    torch.testing.assert_close(outs[8], stock[8], rtol=1e-5, atol=1e-5)   # same function, other order


@pytest.mark.slow
def test_tiny_qwen3_moe_rows_identical_for_batch_1_3_8():
    """fp32 tiny Qwen3-MoE (2 layers, 8 experts top-2, hidden 128, head_dim 64, vocab 512).
    fp32 is the case where MKL takes small-M paths (router/experts/heads); whether the stock
    kernels are invariant is the machine's business and not asserted."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_experts=8, num_experts_per_tok=2, max_position_embeddings=128, norm_topk_prob=True)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    ids = torch.randint(0, 512, (8, 12))

    def run():
        with torch.no_grad():
            return {bs: model(ids[:bs]).logits for bs in (1, 3, 8)}

    stock = run()
    with batch_invariant_mode():
        outs = run()
    assert _rows_equal(outs)
    torch.testing.assert_close(outs[8], stock[8], rtol=1e-4, atol=1e-4)
