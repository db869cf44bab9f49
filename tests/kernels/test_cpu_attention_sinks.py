"""Attention sinks and a sliding window in the fused CPU attention kernel (GPT-OSS's attention;
``kernels/csrc/attention.c``, ``cpu_attention.attention_spec``):

- the compiled kernel equals its specification bit for bit with sinks and windows of any size
  (padded batches, GQA, float32 and bf16), and so does the paged read of the engine;
- a query's bits depend only on its own sequence: decode over the cache equals the prefill
  row, a padded batch equals each sequence alone;
- it is the attention HF transformers' GPT-OSS computes (float64 reference: a sink logit per
  head in the denominator, keys ``pos - W < j <= pos``), with the reference's gradients
  (sinks included);
- without sinks and with a window covering every key it is the plain kernel, bit for bit.
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from skyrl_numerics.kernels import cpu, cpu_attention as ca, native, reference as ref

pytestmark = pytest.mark.isa


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _qkv(gen, B, H, Hkv, Sq, Skv, D, dtype):
    return (torch.randn(B, H, Sq, D, generator=gen).to(dtype),
            torch.randn(B, Hkv, Skv, D, generator=gen).to(dtype),
            torch.randn(B, Hkv, Skv, D, generator=gen).to(dtype))


@settings(max_examples=50, deadline=None)
@given(B=st.integers(1, 3), Hkv=st.sampled_from([1, 2]), g=st.sampled_from([1, 2, 3]),
       D=st.sampled_from([8, 16, 64]), Skv=st.integers(1, 160), sq=st.integers(1, 40),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), padded=st.booleans(),
       window=st.sampled_from([None, 1, 5, 32, 64, 100]), with_sinks=st.booleans(),
       sink_scale=st.sampled_from([0.1, 3.0, 30.0]), block_n=st.sampled_from([7, 64]),
       seed=st.integers(0, 2 ** 16))
def test_kernel_with_sinks_and_window_equals_its_specification(B, Hkv, g, D, Skv, sq, dtype, padded,
                                                               window, with_sinks, sink_scale,
                                                               block_n, seed):
    gen = torch.Generator().manual_seed(seed)
    Sq, H = min(sq, Skv), Hkv * g
    q, k, v = _qkv(gen, B, H, Hkv, Sq, Skv, D, dtype)
    sinks = (torch.randn(H, generator=gen) * sink_scale).to(dtype) if with_sinks else None
    lens = torch.randint(Sq, Skv + 1, (B,), generator=gen) if padded else None
    got = ca.attention(q, k, v, True, None, block_n, lens, sinks, window)
    want = ca.attention_spec(q, k, v, True, None, block_n, lens, sinks=sinks, window=window)
    assert torch.equal(_bits(got), _bits(want))


def test_the_c_kernel_runs_here():
    assert native.lib() is not None, native.unavailable_reason()


@pytest.mark.parametrize("window", [None, 16, 70])
def test_decode_of_a_padded_batch_equals_each_request_alone(window):
    """The engine's decode (one query per request over its cached keys, garbage past each
    length) equals that query's row in its own prefill, with sinks and a window."""
    gen = torch.Generator().manual_seed(4)
    lens = torch.randint(1, 151, (12,), generator=gen)
    q, k, v = _qkv(gen, 12, 4, 2, 1, 150, 64, torch.bfloat16)
    sinks = torch.randn(4, generator=gen).bfloat16()
    for b in range(12):
        k[b, :, int(lens[b]):] = float("nan")
        v[b, :, int(lens[b]):] = float("inf")
    batch = cpu.attention(q, k, v, True, None, 64, lens, sinks, window)
    for b in range(12):
        n = int(lens[b])
        qs = torch.randn(1, 4, n, 64, generator=gen).bfloat16()
        qs[:, :, -1] = q[b:b + 1, :, 0]
        alone = cpu.attention(qs, k[b:b + 1, :, :n], v[b:b + 1, :, :n], True, None, 64, None,
                              sinks, window)
        assert torch.equal(_bits(batch[b, :, 0]), _bits(alone[0, :, -1])), b


@pytest.mark.parametrize("window", [None, 3, 40])
def test_close_to_the_float64_reference_and_to_hf_gpt_oss(window):
    """Within float32 rounding of the float64 reference, which is HF's eager GPT-OSS attention
    (``eager_attention_forward``: a sink column appended to the scores, dropped after softmax;
    its sliding mask keeps ``pos - W < j``)."""
    from transformers.masking_utils import sliding_window_causal_mask_function
    from transformers.models.gpt_oss import modeling_gpt_oss as M

    gen = torch.Generator().manual_seed(7)
    q, k, v = _qkv(gen, 2, 4, 2, 50, 50, 64, torch.float32)
    sinks = torch.randn(4, generator=gen)
    got = ca.attention(q, k, v, True, None, 64, None, sinks, window)
    want = ref.attention(q.double(), k.double(), v.double(), True, None, sinks=sinks, window=window)
    assert (got.double() - want).abs().max() < 1e-5
    mod = torch.nn.Module()
    mod.num_key_value_groups, mod.sinks, mod.training = 2, torch.nn.Parameter(sinks.double()), False
    pos = torch.arange(50)
    fn = sliding_window_causal_mask_function(window) if window else (lambda b, h, i, j: j <= i)
    allowed = torch.stack([torch.stack([torch.as_tensor(fn(0, 0, i, j)) for j in pos]) for i in pos])
    mask = torch.zeros(50, 50, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    hf, _ = M.eager_attention_forward(mod, q.double(), k.double(), v.double(), mask[None, None],
                                      scaling=64 ** -0.5)
    assert (hf.transpose(1, 2) - want).abs().max() < 1e-12


def test_no_sinks_and_a_window_past_every_key_is_the_plain_kernel():
    gen = torch.Generator().manual_seed(8)
    q, k, v = _qkv(gen, 2, 4, 2, 90, 90, 64, torch.bfloat16)
    assert torch.equal(_bits(ca.attention(q, k, v, True, None, 64, None, None, 90)),
                       _bits(ca.attention(q, k, v)))


def test_gradients_are_the_references_sinks_included():
    gen = torch.Generator().manual_seed(9)
    q, k, v = (t.requires_grad_(True) for t in _qkv(gen, 1, 4, 2, 20, 20, 16, torch.float32))
    sinks = torch.randn(4, generator=gen).requires_grad_(True)
    out = ca.attention(q, k, v, True, None, 64, None, sinks, 6)
    g = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad(out, (q, k, v, sinks), g)
    qq, kk, vv, ss = (t.detach().double().requires_grad_(True) for t in (q, k, v, sinks))
    want = torch.autograd.grad(ref.attention(qq, kk, vv, True, None, sinks=ss, window=6),
                               (qq, kk, vv, ss), g.double())
    for a, b in zip(got, want):
        assert (a.double() - b).abs().max() < 1e-5


@settings(max_examples=30, deadline=None)
@given(B=st.integers(1, 4), L=st.integers(1, 120), sq=st.integers(1, 4),
       window=st.sampled_from([None, 4, 33]), native_on=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_paged_read_with_sinks_and_window_equals_the_gathered_rows(B, L, sq, window, native_on, seed):
    gen = torch.Generator().manual_seed(seed)
    Hkv, D, S, Sq = 2, 64, 512, min(sq, L)
    slots = torch.randn(S, 2 * Hkv * D, generator=gen).bfloat16()
    k_pool = slots[:, :Hkv * D].unflatten(1, (Hkv, D))
    v_pool = slots[:, Hkv * D:].unflatten(1, (Hkv, D))
    rows = torch.randperm(S, generator=gen)[:B * L].view(B, L)
    lens = torch.randint(Sq, L + 1, (B,), generator=gen)
    q = torch.randn(B, 4, Sq, D, generator=gen).bfloat16()
    sinks = torch.randn(4, generator=gen).bfloat16()
    with pytest.MonkeyPatch.context() as mp:
        if not native_on:
            mp.setattr(native, "lib", lambda: None)
        got = ca.paged_attention(q, k_pool, v_pool, rows, lens, sinks=sinks, window=window)
    want = ca.attention_spec(q, k_pool[rows].transpose(1, 2), v_pool[rows].transpose(1, 2), True,
                             None, 64, lens, sinks=sinks, window=window)
    assert torch.equal(_bits(got), _bits(want))
