"""Every Triton kernel at real sizes on the GPU (marked ``gpu``, skipped without a CUDA device):
rows bitwise invariant across batch prefixes and row order, decode == prefill for attention,
the exact dW order of rms_norm, and agreement with the float64 reference within a dtype
tolerance. bf16 inputs here run the bf16 ``tl.dot`` (tensor cores), which the interpreter never
executes. Sizes: ``device_cases.SIZES`` (tiny in ``benchmarks/gpu_check.py --dry-run``)."""
import pytest
import torch

from device_cases import CUDA_ONLY, SIZES, TOL, resolve

pytestmark = [pytest.mark.triton, pytest.mark.parametrize("device", CUDA_ONLY),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]
T = dict(backend="triton")


@pytest.fixture
def rnd(device):
    g = torch.Generator(device=resolve(device)).manual_seed(0)

    def make(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=g, device=resolve(device)) * scale).to(dtype)
    return make


def _rows_invariant(fn, rows, ms, device):
    """fn(idx) computes the op on rows ``idx`` of its inputs: every batch prefix and a shuffled
    batch give the bits of the same rows of the full batch. Returns the full batch."""
    ar = torch.arange(rows, device=resolve(device))
    full = fn(ar)
    bad = [m for m in ms if m <= rows and not torch.equal(fn(ar[:m]), full[:m])]
    assert not bad, f"batch prefixes differing from the full {rows}-row batch: {bad}"
    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(1), device="cpu").to(full.device)
    assert torch.equal(fn(perm), full[perm]), "a shuffled batch differs"
    return full


def _close(got, want, dtype, record_property, tol=None):
    tol = TOL[dtype] if tol is None else tol
    g, w = got.double(), want.double()
    err = float((g - w).abs().max() / w.abs().max().clamp_min(1e-30)) if g.numel() else 0.0
    record_property("max_rel_err", err)
    record_property("tol", tol)
    assert err <= tol, f"max relative error {err:.3g} > {tol:g} vs the float64 reference"


@pytest.mark.parametrize("case", range(len(SIZES["mm"])), ids=[f"{d}-{m}x{k}x{n}" for d, m, k, n in SIZES["mm"]])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_matmul(case, bias, device, rnd, record_property):
    from skyrl_numerics.kernels import ops, reference as ref
    dt, M, K, N = SIZES["mm"][case]
    dtype = getattr(torch, dt)
    a, b, c = rnd(M, K, dtype=dtype), rnd(K, N, dtype=dtype), rnd(N, dtype=dtype) if bias else None
    full = _rows_invariant(lambda i: ops.matmul(a[i], b, c, **T), M, SIZES["mm_ms"], device)
    n = min(M, 256)
    _close(full[:n], ref.matmul(a[:n], b, c), dtype, record_property)


def test_matmul_backward_rows(device, rnd):
    from skyrl_numerics.kernels import ops
    _, M, K, N = SIZES["mm"][2]
    a, b, go = rnd(M, K).requires_grad_(), rnd(K, N), rnd(M, N)
    ops.matmul(a, b, **T).backward(go)
    m = SIZES["mm_ms"][1]
    a1 = a.detach()[:m].clone().requires_grad_()
    ops.matmul(a1, b, **T).backward(go[:m])
    assert torch.equal(a1.grad, a.grad[:m])


def test_bmm(device, rnd, record_property):
    from skyrl_numerics.kernels import ops, reference as ref
    B, M, K, N = SIZES["bmm"]
    a, b = rnd(B, M, K), rnd(B, K, N)
    full = ops.bmm(a, b, **T)
    assert torch.equal(ops.bmm(a[:, :1], b, **T), full[:, :1])
    assert torch.equal(ops.bmm(a[:, :3], b, **T), full[:, :3])
    assert torch.equal(ops.bmm(a[:1], b[:1], **T), full[:1])
    _close(full[:2, :64], ref.bmm(a[:2, :64], b[:2]), torch.bfloat16, record_property)


def test_grouped_matmul(device, rnd, record_property):
    from skyrl_numerics.kernels import ops, reference as ref
    Tn, E, K, N = SIZES["grouped"]
    cuts = sorted(torch.randint(0, Tn + 1, (E - 1,), generator=torch.Generator().manual_seed(2),
                                device="cpu").tolist())
    offs = torch.tensor([0] + cuts + [Tn], device="cpu")
    offs[2] = offs[1]                                        # an empty expert
    x, w = rnd(Tn, K), rnd(E, K, N)
    full = ops.grouped_matmul(x, w, offs.to(x.device), **T)
    bad = []
    for e in range(E):
        lo, hi = int(offs[e]), int(offs[e + 1])
        alone = torch.zeros(E + 1, dtype=torch.long, device="cpu")
        alone[e + 1:] = hi - lo
        if hi > lo and not torch.equal(ops.grouped_matmul(x[lo:hi], w, alone.to(x.device), **T), full[lo:hi]):
            bad.append(e)
    assert not bad, f"experts whose rows differ when they run alone: {bad} (offsets {offs.tolist()})"
    n = min(Tn, 512)
    _close(full[:n], ref.grouped_matmul(x[:n], w, offs.clamp(max=n).to(x.device)), torch.bfloat16,
           record_property)


def test_log_softmax_and_token_logprob_entropy(device, rnd, record_property):
    from skyrl_numerics.kernels import ops, reference as ref, tl_softmax
    R, V = SIZES["vocab"]
    ms = (1, 3, R // 2)
    x = rnd(R, V, scale=3.0)
    full = _rows_invariant(lambda i: ops.log_softmax(x[i], **T), R, ms, device)
    _close(full, ref.log_softmax(x), torch.bfloat16, record_property, tol=2e-2)
    y, gy = tl_softmax.log_softmax_fwd(x), rnd(R, V)
    _rows_invariant(lambda i: tl_softmax.log_softmax_bwd(gy[i], y[i]), R, ms, device)
    tgt = torch.randint(0, V, (R,), generator=torch.Generator().manual_seed(3), device="cpu").to(x.device)

    def fwd(i):
        return torch.stack(ops.token_logprob_entropy(x[i], tgt[i], 0.7, **T), -1)

    def bwd(i):
        t = x[i].detach().clone().requires_grad_()
        lp, ent = ops.token_logprob_entropy(t, tgt[i], 0.7, **T)
        (lp.sum() + 0.1 * ent.sum()).backward()
        return t.grad
    full = _rows_invariant(fwd, R, ms, device)
    _rows_invariant(bwd, R, ms, device)
    rlp, rent = ref.token_logprob_entropy(x, tgt, 0.7)
    _close(full, torch.stack([rlp, rent], -1).float(), torch.float32, record_property, tol=1e-4)


def test_rms_norm(device, rnd, record_property):
    from skyrl_numerics.kernels import ops, reference as ref, tl_rmsnorm
    M, N = SIZES["rms"]
    x, w = rnd(M, N, scale=2.0), rnd(N)
    full = _rows_invariant(lambda i: ops.rms_norm(x[i], w, 1e-6, **T), M, (1, 3, 16), device)
    _close(full, ref.rms_norm(x, w, 1e-6), torch.bfloat16, record_property)
    _, rstd = tl_rmsnorm.forward(x, w, 1e-6)
    go = rnd(M, N)
    dx, _ = tl_rmsnorm.backward(go, x, w, rstd)
    assert torch.equal(tl_rmsnorm.backward(go[:3], x[:3], w, rstd[:3])[0], dx[:3])
    _, dw32 = tl_rmsnorm.backward(go, x, w.float(), rstd)
    want = ref.rms_norm_dw_ordered(go, x, rstd, tl_rmsnorm.ROWS_PER_BLOCK)
    assert torch.equal(dw32, want), f"dW not bitwise the ordered reference: max abs diff " \
                                    f"{float((dw32 - want).abs().max()):.3g}"


@pytest.mark.parametrize("op", ["mean", "sum"])
def test_mean_sum(op, device, rnd, record_property):
    from skyrl_numerics.kernels import ops, reference as ref
    P, R = SIZES["reduce"]
    x = rnd(P, R)
    full = _rows_invariant(lambda i: getattr(ops, op)(x[i], -1, dtype=torch.float32, **T), P, (1, 3), device)
    _close(full, getattr(ref, f"{op}_dim")(x.float(), -1), torch.float32, record_property)


def test_attention(device, rnd, record_property):
    from skyrl_numerics.kernels import ops, reference as ref
    B, H, Hkv, S, D = SIZES["attn"]
    q, k, v = rnd(B, H, S, D), rnd(B, Hkv, S, D), rnd(B, Hkv, S, D)
    pre = ops.attention(q, k, v, **T)
    step = SIZES["attn_step"]
    bad = [i for i in range(0, S, step) if not torch.equal(
        ops.attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], **T), pre[:, :, i:i + 1])]
    assert not bad, f"decode != prefill at positions {bad} (checked every {step})"
    c = S // 3
    assert torch.equal(ops.attention(q[:, :, c:2 * c], k[:, :, :2 * c], v[:, :, :2 * c], **T),
                       pre[:, :, c:2 * c]), "chunked prefill != prefill"
    if B > 1:
        assert torch.equal(ops.attention(q[:1], k[:1], v[:1], **T), pre[:1]), "not batch invariant"
    B, H, Hkv, S, D = SIZES["attn_ref"]
    q, k, v = rnd(B, H, S, D), rnd(B, Hkv, S, D), rnd(B, Hkv, S, D)
    _close(ops.attention(q, k, v, **T), ref.attention(q, k, v), torch.bfloat16, record_property)
