"""The bf16 GEMM's AMX arithmetic (``SKYRL_NUMERICS_GEMM=amx``, ``kernels/csrc/gemm_bf16_amx.c``,
:mod:`skyrl_numerics.kernels.cpu_gemm_amx`): an output depends only on its own row of x and of
w (any M, any column split, any group layout, any other rows beside it); the numbers are a
float32 dot product of the bfloat16 values (the standard error bound, and no worse than stock
torch's float32 GEMM on the same values); the arithmetic is named in the execution contract and
a bad or unrunnable choice is refused by name. The invariant model under it keeps its claims
(trainer == engine, packed == alone): ``test_invariant_claims_hold_under_amx`` runs those
tests again in a child with the variable set. A host without AMX skips all of it, saying why.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl_numerics.errors import ContractMismatch
from skyrl_numerics.invariant import contract
from skyrl_numerics.kernels import cpu_gemm_amx as amx
from skyrl_numerics.kernels import cpu_gemm_bf16 as gb

REPO = Path(__file__).resolve().parents[2]
needs_amx = pytest.mark.skipif(not amx.available(), reason=f"no AMX here: {amx.unavailable_reason()}")


def under_amx(test):
    """Run ``test`` with ``SKYRL_NUMERICS_GEMM=amx`` (per example, under hypothesis too)."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(amx.GEMM_ENV, "amx")
            return test(*args, **kwargs)
    return run


def _data(seed, M, K, N, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(M, K, generator=g) * scale).bfloat16(),
            (torch.randn(N, K, generator=g) * scale).bfloat16())


def _bits(t):
    return t.view(torch.int32)


def _on_threads(threads, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@needs_amx
@settings(max_examples=30, deadline=None)
@given(M=st.integers(1, 70), K=st.sampled_from([1, 31, 32, 33, 100, 768]),
       N=st.sampled_from([1, 15, 16, 17, 48, 97, 300]), seed=st.integers(0, 2**16),
       threads=st.sampled_from([1, 2]))
@under_amx
def test_a_row_is_the_same_in_any_batch_any_split_and_beside_any_rows(M, K, N, seed, threads):
    """Each row of an M-row call equals the row alone, the row beside other random rows, and
    the call split over two threads (the pool's column split); the same bits, not close ones."""
    x, w = _data(seed, M, K, N)
    full = _on_threads(threads, lambda: gb.linear_f32(x, w))
    assert torch.equal(_bits(full), _bits(_on_threads(1, lambda: gb.linear_f32(x, w))))
    others, _ = _data(seed + 1, 40, K, 1)
    for m in sorted({0, M // 2, M - 1}):
        assert torch.equal(_bits(gb.linear_f32(x[m:m + 1], w)), _bits(full[m:m + 1]))
        mixed = torch.cat([others[:m % 17], x[m:m + 1], others[m % 17:]])
        assert torch.equal(_bits(gb.linear_f32(mixed, w)[m % 17]), _bits(full[m]))


@needs_amx
@settings(max_examples=15, deadline=None)
@given(counts=st.lists(st.integers(0, 37), min_size=1, max_size=6), K=st.sampled_from([16, 100, 256]),
       N=st.sampled_from([7, 64]), seed=st.integers(0, 2**16))
@under_amx
def test_grouped_rows_are_each_groups_own_call(counts, K, N, seed):
    g = torch.Generator().manual_seed(seed)
    R = sum(counts)
    x = torch.randn(R, K, generator=g).bfloat16()
    ws = [torch.randn(N, K, generator=g).bfloat16() for _ in counts]
    off = np.concatenate([[0], np.cumsum(counts)])
    got = gb.grouped(x, ws, off)
    for j, c in enumerate(counts):
        if c:
            want = gb.linear_f32(x[off[j]:off[j + 1]], ws[j])
            assert torch.equal(_bits(got[off[j]:off[j + 1]]), _bits(want))


@needs_amx
@under_amx
def test_strided_operands_and_float32_activations():
    """A strided x or w gives the contiguous bits; float32 activations keep the fma arithmetic
    (its torch specification), on both sides alike."""
    x, w = _data(5, 9, 96, 40)
    want = gb.linear_f32(x, w)
    wide = torch.zeros(9, 200, dtype=torch.bfloat16)
    wide[:, 50:146] = x
    assert torch.equal(_bits(gb.linear_f32(wide[:, 50:146], w)), _bits(want))
    assert torch.equal(_bits(gb.linear_f32(x, w.t().contiguous().t())), _bits(want))
    assert torch.equal(_bits(gb.linear_f32(x.float(), w)), _bits(gb.linear_spec(x, w)))
    assert not torch.equal(_bits(gb.linear_f32(x.float(), w)), _bits(want))


@needs_amx
@pytest.mark.parametrize("scale", [1.0, 2.0 ** 40, 2.0 ** -40])
@under_amx
def test_close_to_the_exact_product_and_no_worse_than_stock(scale):
    """|err| <= 1.01 K u sum|x w| against numpy's float64 product of the same bfloat16 values
    (u = 2^-24: float32 accumulation of exact bf16 products, any order), and the mean error is
    within 2x that of stock torch's float32 GEMM (MKL) on the same values."""
    K = 1000
    x, w = _data(3, 20, K, 33, scale=scale)
    xs, wsn = x.double().numpy(), w.double().numpy()
    exact = xs @ wsn.T
    got = gb.linear_f32(x, w).double().numpy()
    stock = (x.float() @ w.float().T).double().numpy()
    bound = 1.01 * K * 2.0 ** -24 * (np.abs(xs) @ np.abs(wsn).T)
    assert np.all(np.abs(got - exact) <= bound)
    assert np.mean(np.abs(got - exact)) <= 2 * np.mean(np.abs(stock - exact))


@needs_amx
@under_amx
def test_nan_and_inf_propagate():
    x, w = _data(1, 3, 40, 5)
    x[0, 3] = float("inf")
    x[1, 0] = float("nan")
    got = gb.linear_f32(x, w)
    assert torch.isinf(got[0]).all() and torch.isnan(got[1]).all() and torch.isfinite(got[2]).all()


def test_the_arithmetic_is_named_and_refused_by_name(monkeypatch):
    monkeypatch.setenv(amx.GEMM_ENV, "tiles")
    with pytest.raises(amx.GemmArithmeticError, match="SKYRL_NUMERICS_GEMM='tiles'"):
        gb.linear_f32(*_data(0, 2, 8, 3))
    monkeypatch.setenv(amx.GEMM_ENV, "amx")
    monkeypatch.setattr(amx, "available", lambda: False)      # a host without AMX (cannot exist here)
    with pytest.raises(amx.GemmArithmeticError, match="SKYRL_NUMERICS_GEMM=amx"):
        gb.linear_f32(*_data(0, 2, 8, 3))
    monkeypatch.delenv(amx.GEMM_ENV)
    x, w = _data(0, 2, 8, 3)
    assert torch.equal(_bits(gb.linear_f32(x, w)), _bits(gb.linear_spec(x, w)))   # default: fma


def test_the_advice_names_the_variable_only_where_it_would_help(monkeypatch):
    monkeypatch.delenv(amx.GEMM_ENV, raising=False)
    monkeypatch.setattr(amx, "available", lambda: True)
    assert amx.GEMM_ENV + "=amx" in amx.advice()
    monkeypatch.setattr(amx, "available", lambda: False)     # a CPU without AMX (mocked)
    assert amx.advice() is None
    if amx.native.lib() is not None and amx.native.lib().skyrl_amx_available():
        monkeypatch.undo()
        monkeypatch.setenv(amx.GEMM_ENV, "amx")
        assert amx.advice() is None                          # already on it


@needs_amx
def test_the_contract_tells_the_two_arithmetics_apart(monkeypatch, qwen_moe_dir):
    """A trainer on fma and an engine on amx (or the reverse) are refused, naming kernel_build
    and the arithmetic; the default leaves kernel_build what it was."""
    from skyrl_numerics.invariant.qwen3_moe import InvariantQwen3Moe

    model = InvariantQwen3Moe.from_checkpoint(qwen_moe_dir)
    monkeypatch.delenv(amx.GEMM_ENV, raising=False)
    fma_side = contract.of_model(model)
    monkeypatch.setenv(amx.GEMM_ENV, "amx")
    amx_side = contract.of_model(model)
    assert [d[0] for d in fma_side.diff(amx_side)] == ["kernel_build"]
    with pytest.raises(ContractMismatch, match="kernel_build"):
        contract.check(fma_side, amx_side)
    assert amx_side.kernel_build == fma_side.kernel_build + " gemm_bf16=amx"


@pytest.mark.vllm
@pytest.mark.skipif(os.environ.get(amx.GEMM_ENV) != "amx", reason="runs in the amx child below")
def test_the_engine_and_the_trainer_run_amx_when_asked(vllm_qwen_invariant, qwen_moe_dir):
    """In the child: the engine's worker reports the amx arithmetic in its contract, the same
    contract as this process's trainer model (so the bitwise tests beside it compare amx with
    amx), and this process's bf16 GEMMs are not the fma arithmetic's."""
    from skyrl_numerics.invariant.qwen3_moe import InvariantQwen3Moe

    engine = vllm_qwen_invariant.contract()
    assert engine.kernel_build.endswith(" gemm_bf16=amx"), engine.kernel_build
    assert engine.kernel_build == contract.of_model(InvariantQwen3Moe.from_checkpoint(qwen_moe_dir)).kernel_build
    x, w = _data(0, 4, 64, 8)
    assert not torch.equal(_bits(gb.linear_f32(x, w)), _bits(gb.linear_spec(x, w)))


@needs_amx
@pytest.mark.slow
def test_invariant_claims_hold_under_amx(tmp_path):
    """The invariant families' claims (packed == alone, paged chunked decode == the trainer's
    forward, grouped experts == the loop, no-grad == autograd) and the real vLLM engine against
    the trainer, bit for bit, in a child pytest with ``SKYRL_NUMERICS_GEMM=amx`` (the engine's
    workers inherit it)."""
    env = {**os.environ, amx.GEMM_ENV: "amx"}
    log = tmp_path / "amx.log"
    files = ["tests/invariant/test_invariant_families.py", "tests/invariant/test_invariant_model.py",
             "tests/e2e/test_batch_invariant_vllm.py",
             "tests/kernels/test_gemm_amx.py::test_the_engine_and_the_trainer_run_amx_when_asked"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "isa or vllm",
           "--rootdir", str(REPO), "-x", *files]
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, env=env, cwd=str(REPO), stdout=fh, stderr=subprocess.STDOUT, timeout=1800)
    tail = "\n".join(log.read_text().splitlines()[-40:])
    assert proc.returncode == 0, f"under SKYRL_NUMERICS_GEMM=amx (rc {proc.returncode}):\n{tail}"
    assert " passed" in tail and " failed" not in tail, tail
