"""batch_invariant_mode() holds in any trainer, or says where it cannot (issue 37, item 1):

* every matmul-family overload (in place, ``.out``, ``out_dtype``, mv/dot, the composites
  matmul/linear): rows of ``x[:M] @ W`` have the bits of the same rows for M = 300, and agree with
  stock torch within the GEMM rounding bound;
* ``strict=True`` names an uncovered reduction (``NotInvariant``), non-strict warns once per op;
* ``torch.compile`` inside the mode (SDPA and eager attention, compiled before or inside, with or
  without the watch): the bits of eager under the mode; the CPU SDPA override's outputs and
  gradients have the stock op's strides;
* bf16 autocast: SDPA's ``enable_gqa`` and ``repeat_kv`` give the same bits, forward and input
  gradients, and a padded batch's rows equal each sequence alone on a tiny Llama.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from skyrl_numerics.errors import NotInvariant
from skyrl_numerics.kernels import (batch_invariant_mode, cpu, disable_batch_invariant_cpu,
                                    enable_batch_invariant_cpu, mode, mode_watch)
from skyrl_numerics.kernels.cpu_sdpa import repeat_kv

A = torch.ops.aten
K, N, FULL = 96, 40, 300
EPS = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}


def _data(dtype):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(FULL, K, generator=g), torch.randn(K, N, generator=g)
    acc, bias = torch.randn(FULL, N, generator=g), torch.randn(N, generator=g)
    return x.to(dtype), w.to(dtype), acc.to(dtype), bias.to(dtype)


def _halves(t):
    """(M, K) -> (2, M, K/2): the two halves of the depth as a batch (their products sum to t @ W)."""
    return t.view(t.shape[0], 2, K // 2).transpose(0, 1)


# variant -> fn(x, W, acc, bias) giving rows x[:M] of its result ((M, N), (M,) or (M, 1));
# ``acc``/``x`` are already cut to M rows. ``stock``: torch has it on CPU without the mode.
VARIANTS = {
    "mm": lambda x, w, acc, b: torch.mm(x, w),
    "mm.out": lambda x, w, acc, b: torch.mm(x, w, out=torch.empty(0, dtype=x.dtype)),
    "mm.dtype": lambda x, w, acc, b: A.mm.dtype(x, w, torch.float32),
    "mm.dtype_out": lambda x, w, acc, b: A.mm.dtype_out(x, w, torch.float32, out=torch.empty(0)),
    "addmm": lambda x, w, acc, b: torch.addmm(b, x, w),
    "addmm.alpha_beta": lambda x, w, acc, b: torch.addmm(acc, x, w, beta=0.5, alpha=2.0),
    "addmm.out": lambda x, w, acc, b: torch.addmm(acc, x, w, out=torch.empty(0, dtype=x.dtype)),
    "addmm_": lambda x, w, acc, b: acc.clone().addmm_(x, w),
    "addmm_.alpha_beta": lambda x, w, acc, b: acc.clone().addmm_(x, w, beta=0.25, alpha=-1.5),
    "addmm.dtype": lambda x, w, acc, b: A.addmm.dtype(acc.float(), x, w, torch.float32),
    "addmm.dtype_out": lambda x, w, acc, b: A.addmm.dtype_out(acc.float(), x, w, torch.float32,
                                                             out=torch.empty(0)),
    "_addmm_activation": lambda x, w, acc, b: A._addmm_activation(b, x, w),
    "_addmm_activation.gelu": lambda x, w, acc, b: A._addmm_activation(b, x, w, use_gelu=True),
    "bmm": lambda x, w, acc, b: torch.bmm(torch.stack([x, -x]), torch.stack([w, w]))[0],
    "bmm.out": lambda x, w, acc, b: torch.bmm(x[None], w[None], out=torch.empty(0, dtype=x.dtype))[0],
    "bmm.dtype": lambda x, w, acc, b: A.bmm.dtype(x[None], w[None], torch.float32)[0],
    "baddbmm": lambda x, w, acc, b: torch.baddbmm(acc[None], x[None], w[None], alpha=0.5)[0],
    "baddbmm_": lambda x, w, acc, b: acc.clone()[None].baddbmm_(x[None], w[None])[0],
    "baddbmm.out": lambda x, w, acc, b: torch.baddbmm(acc[None], x[None], w[None],
                                                      out=torch.empty(0, dtype=x.dtype))[0],
    "baddbmm.dtype": lambda x, w, acc, b: A.baddbmm.dtype(acc[None].float(), x[None], w[None],
                                                          torch.float32)[0],
    "addbmm": lambda x, w, acc, b: torch.addbmm(acc, _halves(x), w.view(2, K // 2, N)),
    "addbmm_": lambda x, w, acc, b: acc.clone().addbmm_(_halves(x), w.view(2, K // 2, N), beta=2),
    "addbmm.out": lambda x, w, acc, b: torch.addbmm(acc, _halves(x), w.view(2, K // 2, N),
                                                    out=torch.empty(0, dtype=x.dtype)),
    "mv": lambda x, w, acc, b: torch.mv(x, w[:, 3]),
    "mv.out": lambda x, w, acc, b: torch.mv(x, w[:, 3], out=torch.empty(0, dtype=x.dtype)),
    "addmv": lambda x, w, acc, b: torch.addmv(acc[:, 0], x, w[:, 3], alpha=3.0),
    "addmv_": lambda x, w, acc, b: acc[:, 0].clone().addmv_(x, w[:, 3]),
    "addmv.out": lambda x, w, acc, b: torch.addmv(acc[:, 0], x, w[:, 3], out=torch.empty(0, dtype=x.dtype)),
    "dot": lambda x, w, acc, b: torch.stack([torch.dot(r, w[:, 3]) for r in x]),
    "vdot": lambda x, w, acc, b: torch.stack([torch.vdot(r, w[:, 3]) for r in x]),
    "matmul.2d": lambda x, w, acc, b: x @ w,
    "matmul.3d": lambda x, w, acc, b: (x[:, None] @ w)[:, 0],
    "matmul.vec": lambda x, w, acc, b: x @ w[:, 0],
    "linear": lambda x, w, acc, b: F.linear(x, w.t(), b),
    "linear.3d": lambda x, w, acc, b: F.linear(x[None], w.t().contiguous(), b)[0],
    "einsum": lambda x, w, acc, b: torch.einsum("mk,kn->mn", x, w),
}
_UP_MM = lambda x, w, acc, b: torch.mm(x.float(), w.float())                      # noqa: E731
_UP_ADDMM = lambda x, w, acc, b: torch.addmm(acc.float(), x.float(), w.float())   # noqa: E731
# out_dtype overloads: CUDA-only in stock torch, compared with the product of the upcast operands
NO_CPU_STOCK = {"mm.dtype": _UP_MM, "mm.dtype_out": _UP_MM, "bmm.dtype": _UP_MM,
                "addmm.dtype": _UP_ADDMM, "addmm.dtype_out": _UP_ADDMM, "baddbmm.dtype": _UP_ADDMM}


def _bound(x, w, acc, dtype, out_dtype):
    """|Δ| allowed vs stock: each side's dot product within K·u·(|x| @ |w|), then one rounding
    to the result's dtype (plus ``acc``'s share); u = 2^-24 (fp32 accumulation)."""
    mag = x.float().abs() @ w.float().abs() + acc.float().abs()
    return 2 * K * EPS[torch.float32] * mag + 2 * EPS[out_dtype] * mag


@pytest.mark.isa
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_matmul_variant_rows_equal_for_any_batch_and_close_to_stock(variant, dtype):
    fn = VARIANTS[variant]
    x, w, acc, b = _data(dtype)
    with batch_invariant_mode(strict=True):
        full = fn(x, w, acc, b)
        bad = [m for m in range(1, 9) if not torch.equal(fn(x[:m], w, acc[:m], b), full[:m])]
    assert not bad, f"{variant}: rows of M = {bad} differ from the same rows of M = {FULL}"
    stock = NO_CPU_STOCK.get(variant, fn)(x, w, acc, b).float()
    err = (full.float() - stock).abs()
    lim = _bound(x, w, acc, dtype, full.dtype)
    lim = lim[:, 3] if full.dim() == 1 else lim[:, :full.shape[1]]
    assert bool((err <= lim).all()), f"{variant}: max |Δ| vs stock {err.max():.3g}"


def test_in_place_variants_write_self_and_respect_alpha_beta():
    x, w, acc, b = _data(torch.float32)
    with batch_invariant_mode(strict=True):
        s = acc.clone()
        assert s.addmm_(x, w, beta=0.0, alpha=1.0) is s
        assert torch.equal(s, torch.mm(x, w))                       # beta = 0: self not read
        s = torch.full_like(acc, float("nan"))
        assert torch.equal(s.addmm_(x, w, beta=0), torch.mm(x, w))   # (NaN in self ignored, as torch)
        s = acc.clone()
        s.addmm_(x, w, beta=0.5, alpha=2.0)
        assert torch.equal(s, (2.0 * cpu.matmul_2d(x, w) + 0.5 * acc))
        v = acc[:, 0].clone()
        assert v.addmv_(x, w[:, 0], beta=0) is v and torch.equal(v, torch.mv(x, w[:, 0]))
    with pytest.raises(NotInvariant, match=r"aten::mm: torch.int64"):
        with batch_invariant_mode():
            torch.mm(torch.ones(2, 2, dtype=torch.long), torch.ones(2, 2, dtype=torch.long))


def test_the_family_table_is_the_same_on_both_keys():
    fam = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", "addbmm", "addbmm_", "mv", "addmv",
           "addmv_", "dot", "vdot", "_addmm_activation"}
    fam |= {f"{op}.out" for op in fam if not op.endswith("_")}
    fam |= {f"{op}.{o}" for op in ("mm", "bmm", "addmm", "baddbmm") for o in ("dtype", "dtype_out")}
    for dev in ("cpu", "cuda"):
        assert fam <= set(mode.registered_ops(dev)), sorted(fam - set(mode.registered_ops(dev)))
    for op in fam:     # every one is a real aten overload
        base, _, ov = op.partition(".")
        getattr(getattr(A, base), ov or "default")


# ---------------------------------------------------------------------------- strict / warn
def test_strict_names_an_uncovered_reduction_and_lets_covered_ops_run():
    x = torch.randn(6, 50)
    with batch_invariant_mode(strict=True):
        torch.softmax(x, -1).sum(-1).mean()                            # overridden
        torch.cumsum(x, -1).amax(-1)                                   # listed row-local
        for fn, op in ((lambda: torch.var(x, -1), "aten::var.correction"),
                       (lambda: torch.logsumexp(x, -1), "aten::logsumexp"),
                       (lambda: torch.linalg.vector_norm(x, dim=-1), "aten::linalg_vector_norm"),
                       (lambda: F.layer_norm(x, (50,)), "aten::native_layer_norm"),
                       (lambda: torch.sum(x, -1, out=torch.empty(0)), "aten::sum.IntList_out")):
            with pytest.raises(NotInvariant) as e:
                fn()
            assert e.value.op == op and op in str(e.value)


def test_non_strict_warns_once_per_op_and_runs_stock(monkeypatch):
    monkeypatch.setattr(mode_watch, "_WARNED", set())
    x = torch.randn(6, 50)
    with batch_invariant_mode(strict=False):
        with pytest.warns(RuntimeWarning, match=r"aten::var\.correction runs stock"):
            v = torch.var(x, -1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            torch.var(x, -1)                                           # second time: silent
    assert torch.equal(v, torch.var(x, -1))


def test_strict_default_comes_from_the_environment(monkeypatch):
    x = torch.randn(4, 8)
    monkeypatch.setenv(mode.STRICT_ENV, "0")
    with batch_invariant_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.std(x, -1)
    monkeypatch.setenv(mode.STRICT_ENV, "1")
    with pytest.raises(NotInvariant, match="aten::std"):
        with batch_invariant_mode():
            torch.std(x, -1)
    assert not mode.is_batch_invariant_mode_enabled()


def test_allow_list_and_overrides_are_disjoint_and_name_their_reasons():
    assert not {op.split(".")[0] for op in mode.registered_ops("cpu")} & mode_watch.ALLOWED
    assert all(len(why) > 20 and ops for why, ops in mode_watch.ROW_LOCAL.items())
    for op in ("sum", "mean", "softmax", "var", "std", "norm", "logsumexp", "prod", "mm", "addmm_"):
        assert not mode_watch.allowed(op), op


# ---------------------------------------------------------------------------- torch.compile
def _llama(attn):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    m = LlamaForCausalLM(cfg)
    m.config._attn_implementation = attn
    return m


LENS = [9, 13, 5, 11]


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 250, (len(LENS), max(LENS)), generator=g)
    mask = torch.stack([(torch.arange(max(LENS)) < n).long() for n in LENS])
    return ids, mask


def _logprobs(m, ids, mask):
    logits = m(input_ids=ids, attention_mask=mask).logits
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_compiled_model_under_the_mode_has_the_bits_of_eager_under_the_mode(attn):
    """Before: SDPA crashed (the override's strides were not the stock op's), eager attention
    differed in 11 of 56 tokens (inductor's own softmax and sums). Now compiled code runs eagerly
    through the mode's kernels: inside the ``with`` block, and under enable_batch_invariant_cpu()
    (process-wide, no watch on the thread)."""
    m = _llama(attn).eval()
    ids, mask = _batch()
    cm = torch.compile(m)
    with torch.no_grad():
        with batch_invariant_mode(strict=True):
            ref = _logprobs(m, ids, mask)
            assert torch.equal(_logprobs(cm, ids, mask), ref)
        enable_batch_invariant_cpu()                  # process-wide, no watch on this thread
        try:
            assert torch.equal(_logprobs(cm, ids, mask), ref)
        finally:
            disable_batch_invariant_cpu()


def test_function_compiled_before_or_entering_the_mode_runs_the_modes_kernels():
    def f(x, w):
        return torch.log_softmax(x @ w, -1).sum(-1)

    x, w = torch.randn(37, 64), torch.randn(64, 50)
    cf = torch.compile(f)
    stock = cf(x, w)                                   # compiled (inductor) outside the mode
    with batch_invariant_mode(strict=True):
        ref = f(x, w)
        assert torch.equal(cf(x, w), ref)
    assert torch.equal(cf(x, w), stock)                # the compiled code is back after the mode

    @torch.compile
    def g(x, w):
        with batch_invariant_mode(strict=True):
            return f(x, w)

    assert torch.equal(g(x, w), ref) and not mode.is_batch_invariant_mode_enabled()


@pytest.mark.parametrize("layout", ["contiguous", "heads_transposed"])
def test_cpu_sdpa_override_returns_the_stock_ops_strides(layout):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 7, 4, 16, generator=g)
    q = q.transpose(1, 2) if layout == "heads_transposed" else q.permute(0, 2, 1, 3).contiguous()
    k, v = torch.randn(2, 4, 7, 16, generator=g), torch.randn(2, 4, 7, 16, generator=g)
    op = A._scaled_dot_product_flash_attention_for_cpu
    bwd = A._scaled_dot_product_flash_attention_for_cpu_backward

    def strides():
        out, lse = op(q, k, v, 0.0, True)
        grads = bwd(torch.ones_like(out), q, k, v, out, lse, 0.0, True)
        return [t.stride() for t in (out, lse, *grads)], [t.dtype for t in (out, lse, *grads)]

    stock = strides()
    meta_out, meta_lse = op(q.to("meta"), k.to("meta"), v.to("meta"), 0.0, True)
    assert stock[0][:2] == [meta_out.stride(), meta_lse.stride()]
    with batch_invariant_mode(strict=True):
        assert strides() == stock


# ---------------------------------------------------------------------------- bf16 autocast
def test_autocast_enable_gqa_and_repeat_kv_give_the_same_bits():
    """fp32 q/k/v (RoPE's output) under bf16 autocast: SDPA with ``enable_gqa`` (transformers
    without a padding mask) and ``repeat_kv`` + SDPA (with one): forward and q/k/v gradients."""
    g = torch.Generator().manual_seed(0)
    q0, k0, v0 = (torch.randn(2, h, 9, 16, generator=g) for h in (4, 2, 2))
    causal = torch.ones(9, 9, dtype=torch.bool).tril()

    def run(gqa):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if gqa:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:
                out = F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), attn_mask=causal)
        out.float().pow(2).sum().backward()
        return out, q.grad, k.grad, v.grad

    with batch_invariant_mode(strict=True):
        a, b = run(True), run(False)
    assert a[0].dtype == torch.bfloat16 and a[2].dtype == torch.float32
    for name, x, y in zip(("out", "dq", "dk", "dv"), a, b):
        assert torch.equal(x, y), name


def test_autocast_padded_batch_rows_equal_each_sequence_alone():
    """A tiny Llama (fp32 weights, bf16 autocast, SDPA): each sequence alone (enable_gqa) and its
    rows in the right-padded batch (repeat_kv): logprobs and input-embedding gradients. Before
    the AutocastCPU override: 56 of 63 gradient rows differed (Llama of test_mode_trace.py)."""
    m = _llama("sdpa").train()
    ids, mask = _batch()

    def run(ids, mask):
        emb = m.get_input_embeddings()(ids).detach().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = m(inputs_embeds=emb, attention_mask=mask).logits
        lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        (lp * mask[:, 1:]).sum().backward()
        return lp.detach(), emb.grad

    with batch_invariant_mode(strict=True):
        lp, grad = run(ids, mask)
        for i, n in enumerate(LENS):
            lp1, g1 = run(ids[i:i + 1, :n], mask[i:i + 1, :n])
            assert torch.equal(lp[i, :n - 1], lp1[0]), f"sequence {i}: logprobs"
            assert torch.equal(grad[i, :n], g1[0]), f"sequence {i}: input-embedding gradient"
