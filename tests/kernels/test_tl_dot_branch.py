"""The kernels' GPU branch (``tl.dot``, ``PORTABLE=False``) run in the Triton interpreter.

Under the interpreter the wrappers normally take the PORTABLE branch (an explicit multiply-sum),
so the ``tl.dot`` lines that run on the GPU would otherwise never execute anywhere. With fp32
inputs the interpreter can run ``tl.dot`` (numpy), so this executes the GPU branch's indexing,
masks, tile walk and stores, and checks the results against the float64 reference. Not bitwise:
numpy's dot result for a row depends on the row's position in the tile (see ``tl_common``);
invariance on the MMA hardware is what the ``gpu``-marked tests check on a GPU
(test_triton_ops.py's ``cuda`` cases, test_triton_real_sizes.py; ``benchmarks/gpu_check.py``).

Marked ``interpreter``: runs in a child pytest with ``TRITON_INTERPRET=1`` in the child's
environment only (tests/triton_child.py), so nothing leaks into other tests.
"""
import pytest

pytestmark = [pytest.mark.triton, pytest.mark.interpreter,
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

SMALL = (16, 16, 16, 2, 4, 1)


def _close(got, want, what, tol=2e-5):
    import torch
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    scale = max(want.double().abs().max().item() if want.numel() else 0.0, 1.0)
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite output"
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} > {tol * scale:.3g}"


def run_checks() -> int:
    """Every matmul-family and attention wrapper with portable=False; returns #cases."""
    import torch

    from skyrl_numerics.kernels import reference as ref
    from skyrl_numerics.kernels import tl_attention, tl_matmul
    from skyrl_numerics.kernels._util import interpreting

    assert interpreting(), "run with TRITON_INTERPRET=1"
    torch.manual_seed(0)
    n = 0
    # matmul: ragged M/N/K (partial tiles in every dim, K not a multiple of BLOCK_K), bias,
    # several tiles per persistent program, and the default fp32 config (64x64x32)
    for (M, K, N), bias, cfg in [((37, 45, 29), False, SMALL), ((1, 17, 5), True, SMALL),
                                 ((50, 16, 33), True, SMALL), ((70, 96, 65), False, None),
                                 ((3, 200, 7), True, None)]:
        a, b = torch.randn(M, K), torch.randn(K, N)
        c = torch.randn(N) if bias else None
        out = tl_matmul.matmul(a, b, c, config=cfg, portable=False)
        _close(out, ref.matmul(a, b, c), f"matmul {M}x{K}x{N} bias={bias} cfg={cfg}")
        n += 1
    # bf16 inputs: the wrapper upcasts to fp32 in the interpreter, IEEE tl.dot on the products
    a, b = torch.randn(20, 40).bfloat16(), torch.randn(40, 24).bfloat16()
    _close(tl_matmul.matmul(a, b, config=SMALL, portable=False).float(), ref.matmul(a, b).float(),
           "matmul bf16", tol=1e-2)
    n += 1
    for B, M, K, N in [(3, 19, 21, 17), (1, 1, 5, 40), (2, 33, 16, 16)]:
        a, b = torch.randn(B, M, K), torch.randn(B, K, N)
        _close(tl_matmul.bmm(a, b, config=SMALL, portable=False), ref.bmm(a, b), f"bmm {B}x{M}x{K}x{N}")
        n += 1
    # grouped: empty experts, segments straddling row tiles, a segment longer than one tile
    for counts, K, N in [([5, 0, 20, 3], 18, 21), ([0, 0, 7], 16, 16), ([40, 1], 9, 33)]:
        offs = torch.tensor([0] + counts).cumsum(0)
        x, w = torch.randn(int(offs[-1]), K), torch.randn(len(counts), K, N)
        _close(tl_matmul.grouped_matmul(x, w, offs, config=SMALL, portable=False),
               ref.grouped_matmul(x, w, offs), f"grouped {counts} K={K} N={N}")
        n += 1
    # attention: prefill and decode kernels, GQA, causal and not, several splits and blocks,
    # key counts that are not multiples of the block or split, decode over a longer cache
    for B, H, Hkv, Sq, Skv, D, causal, mode in [
            (1, 2, 1, 37, 37, 16, True, "prefill"), (2, 4, 2, 21, 50, 16, True, "prefill"),
            (1, 2, 2, 19, 19, 32, False, "prefill"), (2, 4, 1, 1, 45, 16, True, "decode"),
            (1, 2, 1, 5, 70, 16, True, "decode"), (1, 2, 2, 3, 33, 16, False, "decode")]:
        q = torch.randn(B, H, Sq, D)
        k, v = torch.randn(B, Hkv, Skv, D), torch.randn(B, Hkv, Skv, D)
        out = tl_attention.attention(q, k, v, causal, mode=mode, split=32, block_m=16, block_n=16,
                                     portable=False)
        _close(out, ref.attention(q, k, v, causal), f"attention {mode} B={B} H={H}/{Hkv} "
               f"Sq={Sq} Skv={Skv} D={D} causal={causal}")
        n += 1
    # default tile sizes (BLOCK_M = BLOCK_N = 64, split 512) once
    q, k, v = torch.randn(1, 2, 70, 16), torch.randn(1, 1, 70, 16), torch.randn(1, 1, 70, 16)
    _close(tl_attention.attention(q, k, v, portable=False), ref.attention(q, k, v, True),
           "attention default tiles")
    return n + 1


def test_tl_dot_branch_in_interpreter():
    # 5 matmul + 1 bf16 matmul + 3 bmm + 3 grouped + 6 attention + 1 default-tile attention
    assert run_checks() == 19
