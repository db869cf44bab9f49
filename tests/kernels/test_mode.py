"""batch_invariant_mode(): enable / restore / nesting / threads, and whole models."""
import threading

import pytest
import torch

from skyrl_numerics.kernels import (batch_invariant_mode, disable_batch_invariant_cpu,
                                    enable_batch_invariant_cpu, is_batch_invariant_mode_enabled)


def _mm_row0_invariant(a, b):
    return torch.equal(torch.mm(a[:1], b), torch.mm(a, b)[:1])


def test_enable_restore_and_nesting():
    a, b = torch.randn(64, 256), torch.randn(256, 256)
    stock_small = torch.mm(a[:1], b)
    assert not _mm_row0_invariant(a, b)             # stock MKL: M=1 differs from M=64
    assert not is_batch_invariant_mode_enabled()
    with batch_invariant_mode():
        assert _mm_row0_invariant(a, b)
        with batch_invariant_mode():
            assert is_batch_invariant_mode_enabled()
        assert is_batch_invariant_mode_enabled() and _mm_row0_invariant(a, b)
    assert not is_batch_invariant_mode_enabled()
    assert torch.equal(torch.mm(a[:1], b), stock_small)   # stock kernel is back
    with pytest.raises(ValueError):
        with batch_invariant_mode():
            raise ValueError("boom")
    assert not is_batch_invariant_mode_enabled()
    enable_batch_invariant_cpu()
    try:
        assert _mm_row0_invariant(a, b)
    finally:
        disable_batch_invariant_cpu()
    assert not is_batch_invariant_mode_enabled()
    with pytest.raises(RuntimeError, match="released more times"):
        disable_batch_invariant_cpu()


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

    outs, grads = run()
    assert not _rows_equal(outs)
    with batch_invariant_mode():
        outs, grads = run()
    assert _rows_equal(outs) and _rows_equal(grads)


@pytest.mark.slow
def test_tiny_qwen3_moe_rows_identical_for_batch_1_3_8():
    """fp32 tiny Qwen3-MoE (2 layers, 8 experts top-2, hidden 128, head_dim 64, vocab 512).
    Stock CPU torch is not invariant here (MKL small-M matmuls in the router/experts/heads).
    In bf16 this CPU's stock bf16 GEMM happens to be invariant already, so fp32 is the case."""
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

    assert not _rows_equal(run())
    with batch_invariant_mode():
        outs = run()
    assert _rows_equal(outs)
