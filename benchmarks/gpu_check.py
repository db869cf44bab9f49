#!/usr/bin/env python
"""One GPU check for skyrl-numerics: every GPU claim, one process, one time budget.

    python benchmarks/gpu_check.py OUT_DIR             # or: OUT=dir python benchmarks/gpu_check.py
    python benchmarks/gpu_check.py OUT_DIR --budget 300 --sections kernels,quant
    python benchmarks/gpu_check.py OUT_DIR --dry-run   # CPU, Triton interpreter, tiny shapes, seconds

Needs only torch (CUDA build) and Triton; transformers is optional (without it the MoE section
uses a built-in plain-torch MoE). Nothing is installed by default: when ``skyrl_numerics`` is not
importable from this checkout, a meta-path finder maps ``skyrl_numerics.kernels`` -> ``kernels/``
etc. from ``[tool.setuptools.package-dir]`` in pyproject.toml (works offline, touches no
site-packages, never reinstalls torch). ``--install`` first tries
``pip install --no-deps --no-build-isolation -e .`` and falls back to that finder.

Sections (run in this order; ``--sections`` picks a subset):
  kernels         every Triton kernel: rows bitwise invariant across batch sizes / row order,
                  decode == prefill for attention, exact dW order for rms_norm, agreement with
                  the float64 reference (within a dtype tolerance: the reference has no fixed
                  reduction order to match bit for bit)
  mode            batch_invariant_mode(): each aten op it claims (mm, addmm, bmm, _grouped_mm,
                  (log_)softmax + backward, mean.dim) row-invariant on the device, and a tiny MoE
                  (HF Qwen3-MoE if transformers imports, else built in) forward + backward rows
                  identical for batch 1/3/8
  quant           Triton fake-quant, every kernel case, bitwise vs the torch recipe (fp32, bf16,
                  edge-case tensors + a large random one), clip mask, GB/s vs ``y.copy_(x)``
  matmul_perf     matmul / bmm / grouped TFLOP/s vs cuBLAS (torch.matmul / bmm / _grouped_mm)
                  at M in {1,16,256,4096} x K,N in {4096,7168,14336}
  attention_perf  invariant attention (prefill, decode) vs torch SDPA

Budget: ``--budget`` seconds (default 480) for all sections. Each section gets a share of what
is left (unused time rolls over); a section whose share has run out stops after its current
case and says so (``partial``); a section reached after the budget is spent is ``skipped`` with
a note. A section that raises is ``failed`` with its traceback and the script goes on. A
watchdog writes the results so far and exits if the budget plus ``--grace`` is exceeded (e.g.
a hung compile). ``gpu.json`` and ``gpu.md`` are rewritten after every section.

gpu.json (schema 1):
  schema, tool, command, dry_run, started_at, wall_s, budget_s, exit_code
  env:      python, platform, torch, torch_cuda, triton, transformers, device, device_name,
            capability, sm_count, memory_gib, nvidia_smi, import_mode ("installed" | "shim" |
            "pip-editable"), triton_interpret, git_commit
  sections: {name: {status, seconds, partial, notes[], rows[], traceback?}}
            status: "ok" | "mismatch" | "failed" | "skipped" | "timeout"
  rows, by section (every row has "ok": true/false/null; "info": true rows are contrasts,
  e.g. stock torch, and never make a section fail):
    kernels        kernel, dtype, shape, check, ok, max_rel_err?, tol?, detail?
    mode           target, check, ok, overridden?, detail?
    quant          recipe, opts, dtype, tensor, bitwise_equal, mask_equal, ok, ms?, gbs?, frac_of_copy?
    matmul_perf    op, dtype, M, K, N, (E), ours_ms, base_ms, ours_tflops, base_tflops,
                   frac_of_base (= base_ms / ours_ms), baseline, ok=null
    attention_perf op, B, H, Hkv, Sq, Skv, D, ours_ms, base_ms, frac_of_base, baseline, ok=null
  summary:  {ok, mismatch, failed, skipped, timeout} counts of sections
Exit code: 0 when no section is mismatch/failed/timeout (skips allowed), 1 otherwise, 2 when
there is no CUDA device and --dry-run was not given (gpu.json is still written).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCHEMA = 1
SECTIONS = ("kernels", "mode", "quant", "matmul_perf", "attention_perf")
SHARES = {"kernels": 2.0, "mode": 1.5, "quant": 2.0, "matmul_perf": 3.0, "attention_perf": 1.0}
SRC = REPO / "src"


# ============================================================================ import bootstrap
def _under(origin, folder: Path) -> bool:
    return bool(origin) and Path(origin).resolve().is_relative_to(folder.resolve())


def _installed_here() -> bool:
    """True when ``skyrl_numerics`` already imports from this checkout (e.g. an editable install).
    An install of another copy is not used: whatever it imported is dropped again."""
    ok = False
    try:
        spec = importlib.util.find_spec("skyrl_numerics")          # does not import
        ok = spec is not None and _under(spec.origin, SRC / "skyrl_numerics")
    except Exception:  # noqa: BLE001
        ok = False
    if not ok:
        for name in [m for m in sys.modules if m == "skyrl_numerics" or m.startswith("skyrl_numerics.")]:
            del sys.modules[name]
    return ok


def ensure_importable(mode: str = "auto") -> str:
    """Make ``skyrl_numerics`` importable from this checkout without touching torch.

    mode: "auto" (installed if it points here, else src/ on sys.path), "shim" (always src/ on
    sys.path), "install" (pip --no-deps --no-build-isolation -e, then src/ if that fails).
    Returns how: "installed", "pip-editable" or "shim".
    """
    if "skyrl_numerics" in sys.modules:
        return "installed"
    if mode == "auto" and _installed_here():
        return "installed"
    if mode == "install":
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
               "--no-index", "-e", str(REPO)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        importlib.invalidate_caches()
        if proc.returncode == 0:
            import site
            for d in site.getsitepackages():
                site.addsitedir(d)   # process the editable install's .pth in this process
            if _installed_here():
                return "pip-editable"
        print(f"pip install -e failed or not visible (rc={proc.returncode}); using the path shim",
              file=sys.stderr)
    sys.path.insert(0, str(SRC))        # the checkout's src/ (what an editable install points at)
    importlib.invalidate_caches()
    return "shim"


# ============================================================================ budget + results
class Budget:
    def __init__(self, seconds: float):
        self.t0 = time.monotonic()
        self.seconds = float(seconds)
        self.section_end = self.t0 + self.seconds

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def start_section(self, share: float, shares_left: float) -> float:
        """Soft deadline for the next section: its share of what is left."""
        slot = max(self.left(), 0.0) * share / max(shares_left, share)
        self.section_end = time.monotonic() + slot
        return slot

    def section_left(self) -> float:
        return min(self.section_end - time.monotonic(), self.left())


class Section:
    """Rows and notes of one section; ``out_of_time()`` marks it partial."""

    def __init__(self, name: str, ctx: "Ctx"):
        self.name, self.ctx = name, ctx
        self.rows: list[dict] = []
        self.notes: list[str] = []
        self.partial = False

    def row(self, **kw) -> dict:
        kw.setdefault("ok", None)
        self.rows.append(kw)
        return kw

    def check(self, ok: bool, **kw) -> bool:
        self.row(ok=bool(ok), **kw)
        return bool(ok)

    def out_of_time(self, what: str, reserve: float = 0.0) -> bool:
        if self.ctx.budget.section_left() > reserve:
            return False
        if not self.partial:
            self.partial = True
            self.notes.append(f"time share used up: stopped before {what}")
        return True


class Ctx:
    def __init__(self, args, budget: Budget):
        import torch
        self.torch = torch
        self.args = args
        self.dry = bool(args.dry_run)
        self.budget = budget
        self.device = "cpu" if self.dry else "cuda"
        self.S = DRY_SHAPES if self.dry else FULL_SHAPES

    def sync(self):
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def time_ms(self, fn, reps: int | None = None, warm: int | None = None) -> float:
        """Median ms of ``reps`` calls after ``warm`` calls (CUDA events on GPU)."""
        torch = self.torch
        reps = reps or self.S["reps"]
        warm = self.S["warm"] if warm is None else warm
        for _ in range(warm):
            fn()
        self.sync()
        times = []
        for _ in range(reps):
            if self.device == "cuda":
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                torch.cuda.synchronize()
                times.append(s.elapsed_time(e))
            else:
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)


FULL_SHAPES = dict(
    reps=20, warm=3, quant_seeds=2,
    mm=(4096, 4096, 4096), mm_fp32=(1024, 1024, 1024), mm_ragged=(1000, 4000, 3000),
    mm_ms=(1, 3, 16, 127, 1000),
    bmm=(8, 512, 1024, 1024), grouped=(4096, 8, 2048, 1024),
    vocab=(64, 151936), rms=(1000, 4096), reduce=(64, 40000),
    attn=(2, 16, 4, 1500, 128), attn_ref=(1, 8, 2, 300, 128), attn_step=37,
    moe=dict(vocab=512, hidden=256, inter=128, layers=2, heads=4, kv_heads=2, head_dim=64,
             experts=8, topk=2, seq=16, dtype="bfloat16"),
    quant_edge=(24, 256), quant_n=64 * 2**20,
    perf_ms=(1, 16, 256, 4096), perf_kn=(4096, 7168, 14336),
    perf_bmm=((8, 1, 4096, 4096), (8, 256, 4096, 4096), (32, 256, 1024, 1024)),
    perf_grouped=((8, 4096, 4096, 14336), (8, 4096, 14336, 4096), (64, 16384, 2048, 1408)),
    perf_attn=((1, 32, 8, 1024, 1024, 128), (1, 32, 8, 4096, 4096, 128), (8, 32, 8, 1, 1024, 128),
               (8, 32, 8, 1, 4096, 128), (1, 32, 8, 1, 16384, 128)),
)
DRY_SHAPES = dict(
    reps=1, warm=0, quant_seeds=1,
    mm=(40, 48, 40), mm_fp32=(24, 40, 24), mm_ragged=(21, 37, 19), mm_ms=(1, 3, 16),
    bmm=(2, 9, 24, 20), grouped=(30, 3, 16, 24),
    vocab=(6, 300), rms=(9, 40), reduce=(5, 90),
    attn=(1, 2, 1, 40, 16), attn_ref=(1, 2, 1, 20, 16), attn_step=9,
    moe=dict(vocab=64, hidden=32, inter=32, layers=1, heads=2, kv_heads=1, head_dim=16,
             experts=4, topk=2, seq=6, dtype="float32"),
    quant_edge=(4, 128), quant_n=4096,
    perf_ms=(1, 16), perf_kn=(32, 64),
    perf_bmm=((2, 1, 32, 32),), perf_grouped=((2, 16, 32, 32),),
    perf_attn=((1, 2, 1, 32, 32, 16), (1, 2, 1, 1, 64, 16)),
)


def _rel_err(got, want) -> float:
    g, w = got.double(), want.double()
    if g.numel() == 0:
        return 0.0
    return float((g - w).abs().max() / w.abs().max().clamp_min(1e-30))


def _tol(dtype) -> float:
    import torch
    return {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]


def _eq(a, b) -> bool:
    import torch
    return a.shape == b.shape and bool(torch.equal(a, b))


# ============================================================================ section: kernels
def section_kernels(sec: Section, ctx: Ctx):
    torch, S, dev = ctx.torch, ctx.S, ctx.device
    from skyrl_numerics.kernels import ops
    from skyrl_numerics.kernels import reference as ref
    from skyrl_numerics.kernels import tl_rmsnorm
    T = dict(backend="triton")
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dtype)

    def prefix_rows(name, fn, rows, ms, dtype, shape, contrast=None):
        """fn(idx) computes the op on the rows ``idx`` of its inputs; the rows of a prefix and of
        a shuffled batch must be the bits of the same rows in the full batch."""
        ar = torch.arange(rows, device=dev)
        full = fn(ar)
        ms = [m for m in ms if m <= rows]
        bad = [m for m in ms if not _eq(fn(ar[:m]), full[:m])]
        sec.check(not bad, kernel=name, dtype=str(dtype), shape=shape, check="rows_invariant",
                  detail=f"batch prefixes m in {ms} vs {rows} rows; differing: {bad}")
        perm = torch.randperm(rows, generator=torch.Generator().manual_seed(1)).to(dev)
        sec.check(_eq(fn(perm), full[perm]), kernel=name, dtype=str(dtype), shape=shape,
                  check="rows_invariant_shuffled")
        if contrast is not None:
            cf = contrast(ar)
            stock_bad = [m for m in ms if not _eq(contrast(ar[:m]), cf[:m])]
            sec.row(info=True, kernel=name + " (stock torch)", dtype=str(dtype), shape=shape,
                    check="rows_invariant", ok=not stock_bad, detail=f"differing: {stock_bad}")
        return full

    def vs_ref(name, got, want, dtype, shape, tol=None):
        tol = _tol(dtype) if tol is None else tol
        err = _rel_err(got, want)
        sec.check(err <= tol, kernel=name, dtype=str(dtype), shape=shape, check="vs_reference",
                  max_rel_err=err, tol=tol)

    # matmul bf16 (+ bias) / fp32 IEEE / ragged shapes (masks in M, N, K)
    for dtype, (M, K, N) in ((torch.bfloat16, S["mm"]), (torch.float32, S["mm_fp32"]),
                             (torch.bfloat16, S["mm_ragged"])):
        if sec.out_of_time(f"matmul {dtype} {M}x{K}x{N}"):
            return
        a, b, bias = rnd(M, K, dtype=dtype), rnd(K, N, dtype=dtype), rnd(N, dtype=dtype)
        shape = f"{M}x{K}x{N}"
        full = prefix_rows("matmul", lambda i: ops.matmul(a[i], b, **T), M, S["mm_ms"], dtype, shape,
                           contrast=lambda i: a[i] @ b)
        nref = min(M, 256)
        vs_ref("matmul", full[:nref], ref.matmul(a[:nref], b), dtype, shape)
        fb = prefix_rows("matmul+bias", lambda i: ops.matmul(a[i], b, bias, **T), M, S["mm_ms"][:2],
                         dtype, shape)
        vs_ref("matmul+bias", fb[:nref], ref.matmul(a[:nref], b, bias), dtype, shape)
        del a, b, full, fb
    # matmul autograd: dA rows invariant (the backward walks the same kernel)
    M, K, N = S["mm_ragged"]
    a = rnd(M, K).requires_grad_()
    b = rnd(K, N)
    go = rnd(M, N)
    ops.matmul(a, b, **T).backward(go)
    ga_full = a.grad.clone()
    m = S["mm_ms"][1]
    a1 = a.detach()[:m].clone().requires_grad_()
    ops.matmul(a1, b, **T).backward(go[:m])
    sec.check(_eq(a1.grad, ga_full[:m]), kernel="matmul backward dA", dtype="torch.bfloat16",
              shape=f"{M}x{K}x{N}", check="rows_invariant", detail=f"m={m}")

    # bmm: slice along M and along the batch
    if sec.out_of_time("bmm"):
        return
    B, M, K, N = S["bmm"]
    a, b = rnd(B, M, K), rnd(B, K, N)
    full = ops.bmm(a, b, **T)
    shape = f"{B}x{M}x{K}x{N}"
    sec.check(_eq(ops.bmm(a[:, :1], b, **T), full[:, :1]) and _eq(ops.bmm(a[:, :3], b, **T), full[:, :3]),
              kernel="bmm", dtype="torch.bfloat16", shape=shape, check="rows_invariant")
    sec.check(_eq(ops.bmm(a[:1], b[:1], **T), full[:1]), kernel="bmm", dtype="torch.bfloat16",
              shape=shape, check="batch_invariant")
    vs_ref("bmm", full[:2, :64], ref.bmm(a[:2, :64], b[:2]), torch.bfloat16, shape)

    # grouped matmul: each expert alone == its rows of the full call; empty experts
    if sec.out_of_time("grouped_matmul"):
        return
    Tn, E, K, N = S["grouped"]
    cuts = sorted(torch.randint(0, Tn + 1, (E - 1,), generator=torch.Generator().manual_seed(2)).tolist())
    offs = torch.tensor([0] + cuts + [Tn])
    offs[2] = offs[1]                                        # an empty expert
    x, w = rnd(Tn, K), rnd(E, K, N)
    full = ops.grouped_matmul(x, w, offs.to(dev), **T)
    bad = []
    for e in range(E):
        lo, hi = int(offs[e]), int(offs[e + 1])
        alone = torch.zeros(E + 1, dtype=torch.long)
        alone[e + 1:] = hi - lo
        if hi > lo and not _eq(ops.grouped_matmul(x[lo:hi], w, alone.to(dev), **T), full[lo:hi]):
            bad.append(e)
    shape = f"T={Tn} E={E} K={K} N={N} offs={offs.tolist()}"
    sec.check(not bad, kernel="grouped_matmul", dtype="torch.bfloat16", shape=shape,
              check="expert_alone_invariant", detail=f"differing experts: {bad}")
    nr = min(Tn, 512)
    vs_ref("grouped_matmul", full[:nr], ref.grouped_matmul(x[:nr], w, offs.clamp(max=nr)),
           torch.bfloat16, shape)

    # log_softmax forward/backward, fused token logprob + entropy forward/backward
    if sec.out_of_time("log_softmax"):
        return
    R, V = S["vocab"]
    ms = (1, 3, R // 2)
    x = rnd(R, V, scale=3.0)
    shape = f"{R}x{V}"
    full = prefix_rows("log_softmax", lambda i: ops.log_softmax(x[i], **T), R, ms, torch.bfloat16, shape,
                       contrast=lambda i: torch.log_softmax(x[i], -1))
    vs_ref("log_softmax", full, ref.log_softmax(x), torch.bfloat16, shape, tol=2e-2)
    from skyrl_numerics.kernels import tl_softmax
    y = tl_softmax.log_softmax_fwd(x)
    gy = rnd(R, V)
    prefix_rows("log_softmax backward", lambda i: tl_softmax.log_softmax_bwd(gy[i], y[i]), R,
                ms, torch.bfloat16, shape)
    tgt = torch.randint(0, V, (R,), generator=torch.Generator().manual_seed(3)).to(dev)

    def tle(i):
        lp, ent = ops.token_logprob_entropy(x[i], tgt[i], 0.7, **T)
        return torch.stack([lp, ent], -1)
    full = prefix_rows("token_logprob_entropy", tle, R, ms, torch.bfloat16, shape)
    rlp, rent = ref.token_logprob_entropy(x, tgt, 0.7)
    vs_ref("token_logprob_entropy", full, torch.stack([rlp, rent], -1).float(), torch.float32, shape,
           tol=1e-4)

    def tle_grad(i):
        t = x[i].detach().clone().requires_grad_()
        lp, ent = ops.token_logprob_entropy(t, tgt[i], 0.7, **T)
        (lp.sum() + 0.1 * ent.sum()).backward()
        return t.grad
    prefix_rows("token_logprob_entropy backward", tle_grad, R, ms, torch.bfloat16, shape)

    # rms_norm forward / dx invariant; dW bitwise equal to the ordered reference
    if sec.out_of_time("rms_norm"):
        return
    M, N = S["rms"]
    x, wn = rnd(M, N, scale=2.0), rnd(N)
    shape = f"{M}x{N}"
    full = prefix_rows("rms_norm", lambda i: ops.rms_norm(x[i], wn, 1e-6, **T), M, (1, 3, 16),
                       torch.bfloat16, shape)
    vs_ref("rms_norm", full, ref.rms_norm(x, wn, 1e-6), torch.bfloat16, shape)
    y, rstd = tl_rmsnorm.forward(x, wn, 1e-6)
    go = rnd(M, N)
    dx, dw = tl_rmsnorm.backward(go, x, wn, rstd)
    dx1, _ = tl_rmsnorm.backward(go[:3], x[:3], wn, rstd[:3])
    sec.check(_eq(dx1, dx[:3]), kernel="rms_norm backward dx", dtype="torch.bfloat16", shape=shape,
              check="rows_invariant")
    _, dw32 = tl_rmsnorm.backward(go, x, wn.float(), rstd)
    want = ref.rms_norm_dw_ordered(go, x, rstd, tl_rmsnorm.ROWS_PER_BLOCK)
    sec.check(_eq(dw32, want), kernel="rms_norm backward dW", dtype="torch.float32", shape=shape,
              check="bitwise_vs_ordered_reference",
              detail=f"max abs diff {float((dw32 - want).abs().max()):.3g}")

    # sum / mean over the last dim
    if sec.out_of_time("mean/sum"):
        return
    P, Rr = S["reduce"]
    x = rnd(P, Rr)
    shape = f"{P}x{Rr}"
    for nm, fn, rf in (("mean", ops.mean, ref.mean_dim), ("sum", ops.sum, ref.sum_dim)):
        full = prefix_rows(nm, lambda i, fn=fn: fn(x[i], -1, dtype=torch.float32, **T), P, (1, 3),
                           torch.float32, shape, contrast=lambda i, nm=nm: getattr(x[i].float(), nm)(-1))
        vs_ref(nm, full, rf(x.float(), -1), torch.float32, shape)

    # attention: decode == prefill bitwise, batch invariant, vs reference
    if sec.out_of_time("attention"):
        return
    B, H, Hkv, Sn, D = S["attn"]
    q, k, v = rnd(B, H, Sn, D), rnd(B, Hkv, Sn, D), rnd(B, Hkv, Sn, D)
    shape = f"B={B} H={H} Hkv={Hkv} S={Sn} D={D}"
    pre = ops.attention(q, k, v, **T)
    bad = [i for i in range(0, Sn, S["attn_step"])
           if not _eq(ops.attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], **T), pre[:, :, i:i + 1])]
    sec.check(not bad, kernel="attention", dtype="torch.bfloat16", shape=shape,
              check="decode_equals_prefill", detail=f"positions checked every {S['attn_step']}; differing: {bad}")
    c = Sn // 3
    chunk = ops.attention(q[:, :, c:2 * c], k[:, :, :2 * c], v[:, :, :2 * c], **T)
    sec.check(_eq(chunk, pre[:, :, c:2 * c]), kernel="attention", dtype="torch.bfloat16", shape=shape,
              check="chunked_prefill_equals_prefill", detail=f"queries {c}:{2 * c}")
    if B > 1:
        sec.check(_eq(ops.attention(q[:1], k[:1], v[:1], **T), pre[:1]), kernel="attention",
                  dtype="torch.bfloat16", shape=shape, check="batch_invariant")
    B, H, Hkv, Sn, D = S["attn_ref"]
    q, k, v = rnd(B, H, Sn, D), rnd(B, Hkv, Sn, D), rnd(B, Hkv, Sn, D)
    vs_ref("attention", ops.attention(q, k, v, **T), ref.attention(q, k, v), torch.bfloat16,
           f"B={B} H={H} Hkv={Hkv} S={Sn} D={D}")


# ============================================================================ section: mode
def _claimed_ops() -> list[str]:
    return ["mm", "addmm", "bmm", "_grouped_mm", "_log_softmax", "_log_softmax_backward_data",
            "_softmax", "_softmax_backward_data", "mean.dim"]


def _op_probes(torch, dev, dtype):
    """op -> (full-batch fn, batch-prefix fn) computing the op; rows compared on the prefix."""
    g = torch.Generator(device=dev).manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=g, device=dev).to(dtype)  # noqa: E731
    M, K, N = 64, 256, 256
    a, b, bias = r(M, K), r(K, N), r(N)
    a3, b3 = r(4, 32, K), r(4, K, N)
    x, gy = r(M, 1000) * 3, r(M, 1000)
    y_ls = torch.log_softmax(x.float(), -1).to(dtype)
    y_s = torch.softmax(x.float(), -1).to(dtype)
    E = 4
    w = r(E, K, N)
    rest = r(48, K)                     # experts 1..3: 16 rows each, the same in every call
    aten = torch.ops.aten
    return {
        "mm": lambda m: aten.mm(a[:m], b),
        "addmm": lambda m: aten.addmm(bias, a[:m], b),
        "bmm": lambda m: aten.bmm(a3[:, :m], b3),
        # rows of expert 0: the first m rows (offsets shifted to keep the other experts' sizes)
        "_grouped_mm": lambda m: torch._grouped_mm(
            torch.cat([a[:m], rest]), w,
            offs=torch.tensor([m, m + 16, m + 32, m + 48], dtype=torch.int32, device=dev))[:m],
        "_log_softmax": lambda m: aten._log_softmax(x[:m], -1, False),
        "_log_softmax_backward_data": lambda m: aten._log_softmax_backward_data(gy[:m], y_ls[:m], -1, dtype),
        "_softmax": lambda m: aten._softmax(x[:m], -1, False),
        "_softmax_backward_data": lambda m: aten._softmax_backward_data(gy[:m], y_s[:m], -1, dtype),
        "mean.dim": lambda m: aten.mean.dim(x[:m], [-1]),
    }


def _rows_identical(outs: dict) -> tuple[bool, str]:
    big = outs[max(outs)]
    bad = [bs for bs, o in outs.items() if not _eq(o, big[:bs])]
    return not bad, f"batch sizes differing from the largest: {bad}"


class _TinyMoE:
    """Plain-torch MoE LM (used when transformers is missing): rmsnorm via mean, attention via
    bmm + softmax, router softmax/top-k, experts via torch._grouped_mm, LM head via mm."""

    def __init__(self, torch, c, dev, dtype):
        self.torch, self.c = torch, c
        g = torch.Generator(device=dev).manual_seed(0)

        def p(*s, scale=0.05):
            return (torch.randn(*s, generator=g, device=dev) * scale).to(dtype).requires_grad_()
        H, I, E, hd = c["hidden"], c["inter"], c["experts"], c["head_dim"]
        self.emb = p(c["vocab"], H, scale=1.0)
        self.layers = [dict(q=p(H, c["heads"] * hd), k=p(H, c["kv_heads"] * hd), v=p(H, c["kv_heads"] * hd),
                            o=p(c["heads"] * hd, H), router=p(H, E), up=p(E, H, I), down=p(E, I, H))
                       for _ in range(c["layers"])]
        self.head = p(H, c["vocab"])
        self.experts_impl = "torch._grouped_mm"
        try:   # the stock op may not exist or not take this dtype/device: per-expert mm then
            e0 = self.layers[0]["up"]
            torch._grouped_mm(torch.zeros(4, H, device=dev, dtype=dtype), e0.detach(),
                              offs=torch.full((E,), 4, dtype=torch.int32, device=dev))
        except Exception as exc:  # noqa: BLE001
            self.experts_impl = f"per-expert mm (torch._grouped_mm raised {type(exc).__name__})"

    def _gmm(self, x, w, ends):
        if self.experts_impl == "torch._grouped_mm":
            return self.torch._grouped_mm(x, w, offs=ends)
        bounds = [0] + ends.tolist()
        return self.torch.cat([x[bounds[e]:bounds[e + 1]] @ w[e] for e in range(w.shape[0])])

    def params(self):
        return [self.emb, self.head] + [t for layer in self.layers for t in layer.values()]

    def _norm(self, x):
        return x * self.torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)

    def _experts(self, x, layer):
        torch, c = self.torch, self.c
        probs = torch.softmax(x @ layer["router"], dim=-1)
        wts, idx = probs.topk(c["topk"], dim=-1)
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        xs = x.repeat_interleave(c["topk"], 0)[order]
        ends = torch.bincount(flat, minlength=c["experts"]).cumsum(0).to(torch.int32)
        h = torch.nn.functional.silu(self._gmm(xs, layer["up"], ends))
        ys = self._gmm(h, layer["down"], ends)
        out = torch.empty_like(ys)
        out[order] = ys
        return (out.reshape(x.shape[0], c["topk"], -1) * wts.unsqueeze(-1)).sum(1)

    def logits(self, x):
        """x: (B, S, H) input embeddings -> (B, S, V) logits."""
        torch, c = self.torch, self.c
        B, S, H = x.shape
        hd, nh, nkv = c["head_dim"], c["heads"], c["kv_heads"]
        mask = torch.full((S, S), float("-inf"), device=x.device).triu(1)
        for layer in self.layers:
            h = self._norm(x).reshape(B * S, H)
            q = (h @ layer["q"]).reshape(B, S, nh, hd).transpose(1, 2)
            k = (h @ layer["k"]).reshape(B, S, nkv, hd).transpose(1, 2).repeat_interleave(nh // nkv, 1)
            v = (h @ layer["v"]).reshape(B, S, nkv, hd).transpose(1, 2).repeat_interleave(nh // nkv, 1)
            s = (q @ k.transpose(-1, -2)) * hd ** -0.5 + mask.to(q.dtype)
            a = (torch.softmax(s.float(), -1).to(q.dtype) @ v).transpose(1, 2).reshape(B * S, nh * hd)
            x = x + (a @ layer["o"]).reshape(B, S, H)
            x = x + self._experts(self._norm(x).reshape(B * S, H), layer).reshape(B, S, H)
        return (self._norm(x).reshape(B * S, H) @ self.head).reshape(B, S, -1)


def _hf_moe(torch, c, dev, dtype, attn):
    import transformers
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=2 * c["inter"],
        moe_intermediate_size=c["inter"], num_hidden_layers=c["layers"],
        num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"], head_dim=c["head_dim"],
        num_experts=c["experts"], num_experts_per_tok=c["topk"], max_position_embeddings=256,
        norm_topk_prob=True, attn_implementation=attn)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).to(device=dev, dtype=dtype).eval()
    return model, cfg


def section_mode(sec: Section, ctx: Ctx):
    torch, dev, S = ctx.torch, ctx.device, ctx.S
    from skyrl_numerics.kernels import batch_invariant_mode
    from skyrl_numerics.kernels import mode as mode_mod
    registered = (set(mode_mod._cuda_kernels()) if dev == "cuda" else set(mode_mod._CPU_KERNELS))
    missing = [op for op in _claimed_ops() if op not in registered]
    if missing:
        sec.notes.append(f"claimed ops without a {dev.upper()} registration in the mode (stock "
                         f"kernels run): {missing}")
    # --- each claimed op, rows of a batch prefix vs the full batch, with and without the mode
    dtypes = (torch.bfloat16, torch.float32)
    for dtype in dtypes:
        probes = _op_probes(torch, dev, dtype)
        for op in _claimed_ops():
            if sec.out_of_time(f"op {op}"):
                return
            fn = probes[op]

            def prefix_bad(fn=fn, op=op):
                full, outs = fn(64), {m: fn(m) for m in (1, 3, 17)}
                return [m for m, o in outs.items() if not _eq(o, full[:, :m] if op == "bmm" else full[:m])]
            try:
                stock_bad = prefix_bad()
            except Exception as exc:  # noqa: BLE001 - torch has no kernel for this dtype/device
                sec.row(target=f"aten.{op}", dtype=str(dtype), check="rows_invariant", ok=None,
                        overridden=op in registered,
                        detail=f"stock torch raises {type(exc).__name__} (unsupported here): {str(exc)[:120]}")
                continue
            sec.row(target=f"aten.{op}", dtype=str(dtype), check="rows_invariant (stock)", info=True,
                    ok=not stock_bad, overridden=op in registered, detail=f"prefix m differing: {stock_bad}")
            try:
                with batch_invariant_mode():
                    bad = prefix_bad()
                ok, detail = not bad, f"prefix m differing: {bad}"
            except Exception as exc:  # noqa: BLE001 - the override fails where stock works
                ok, detail = False, f"raised {type(exc).__name__}: {str(exc)[:200]}"
            sec.check(ok, target=f"aten.{op}", dtype=str(dtype), check="rows_invariant (mode)",
                      overridden=op in registered, detail=detail)
    # --- a tiny MoE forward + backward, batch 1 / 3 / 8
    c = S["moe"]
    dtype = getattr(torch, c["dtype"])
    ids = torch.randint(0, c["vocab"], (8, c["seq"]), generator=torch.Generator().manual_seed(0)).to(dev)
    models = []
    try:
        import transformers  # noqa: F401
        for attn in ("eager", "sdpa"):
            models.append((f"HF Qwen3MoeForCausalLM ({attn})", "hf", attn))
    except Exception as exc:  # noqa: BLE001
        sec.notes.append(f"transformers not importable ({type(exc).__name__}); built-in MoE only")
    models.append(("built-in plain-torch MoE", "builtin", None))
    for name, kind, attn in models:
        if sec.out_of_time(name):
            return
        try:
            if kind == "hf":
                model, cfg = _hf_moe(torch, c, dev, dtype, attn)
                embed = model.get_input_embeddings()
                params = list(model.parameters())
                experts_impl = getattr(cfg, "_experts_implementation", None)

                def logits(e, model=model):
                    return model(inputs_embeds=e).logits
            else:
                tm = _TinyMoE(torch, c, dev, dtype)
                params = tm.params()
                experts_impl = tm.experts_impl

                def embed(i, tm=tm):
                    return tm.emb[i]
                logits = tm.logits

            def run(with_grad):
                outs, grads = {}, {}
                for bs in (1, 3, 8):
                    for p in params:
                        p.grad = None
                    e = embed(ids[:bs]).detach().clone().requires_grad_(with_grad)
                    with torch.set_grad_enabled(with_grad):
                        lg = logits(e)
                        if with_grad:
                            lp = torch.log_softmax(lg.float(), -1)
                            lp.gather(-1, ids[:bs, :, None]).sum().backward()
                            grads[bs] = e.grad
                    outs[bs] = lg.detach()
                finite = all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in params)
                return outs, grads, finite
            detail_model = f"{c['layers']} layers, {c['experts']} experts top-{c['topk']}, hidden " \
                           f"{c['hidden']}, {c['dtype']}, experts: {experts_impl}"
            s_out, s_grad, _ = run(True)
            with batch_invariant_mode():
                f_out, _, _ = run(False)
                m_out, m_grad, finite = run(True)
            ok_s, d_s = _rows_identical(s_out)
            sec.row(target=name, check="forward rows identical b=1/3/8 (stock)", ok=ok_s, info=True,
                    detail=d_s)
            ok_f, d_f = _rows_identical(f_out)
            sec.check(ok_f, target=name, check="forward rows identical b=1/3/8 (mode, no grad)",
                      detail=f"{d_f}; {detail_model}")
            ok_m, d_m = _rows_identical(m_out)
            sec.check(ok_m, target=name, check="forward rows identical b=1/3/8 (mode, grad)", detail=d_m)
            ok_g, d_g = _rows_identical(m_grad)
            sec.row(target=name, check="input-embedding grads rows identical b=1/3/8 (stock)",
                    ok=_rows_identical(s_grad)[0], info=True)
            sec.check(ok_g, target=name, check="input-embedding grads rows identical b=1/3/8 (mode)",
                      detail=d_g)
            sec.check(finite, target=name, check="backward under the mode: all parameter grads finite")
        except Exception as exc:  # noqa: BLE001 - record and go on to the next model
            sec.check(False, target=name, check="forward+backward", detail=f"raised {type(exc).__name__}",
                      traceback=traceback.format_exc(limit=6))


# ============================================================================ section: quant
QUANT_CASES = [
    ("fp8_block", {}), ("fp8_block", {"ue8m0": True}),
    ("mxfp8", {}), ("mxfp8", {"scale_mode": "rceil"}), ("mxfp8", {"elem": "e5m2"}),
    ("mxfp8", {"elem": "e5m2", "scale_mode": "rceil"}), ("mxfp4", {}), ("mxfp4", {"scale_mode": "rceil"}),
    ("nvfp4", {"convention": "vllm"}), ("nvfp4", {"convention": "te"}),
    ("nvfp4", {"convention": "modelopt"}), ("nvfp4", {"convention": "torchao"}),
    ("nvfp4", {"convention": "compressed_tensors"}), ("nvfp4", {"convention": "te", "global_amax": 3.0}),
]


def _quant_edge_data(torch, seed, dtype, shape, dev):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.exp(torch.randn(shape[0], 1, generator=g) * 3)
    x[0, :128] = 0                                             # all-zero blocks
    x[1, :16] = torch.tensor([6.375, 5.0, 0.25, -0.75, 2.5, -3.5, 1e-30, -0.0] * 2)   # ties, tiny, -0
    x[2, :32] = 2.0 ** torch.arange(-16, 16).float()           # a wide block
    x[3] *= 1e-38                                              # fp32-subnormal-ish block amax
    return x.to(dtype).to(dev)


def section_quant(sec: Section, ctx: Ctx):
    torch, dev, S = ctx.torch, ctx.device, ctx.S
    from skyrl_numerics.quant import RECIPES, fake_quant, quantize
    from skyrl_numerics.quant.ste import representable_range
    from skyrl_numerics.quant.triton_fq import SUPPORTED, fake_quant_triton
    for r in RECIPES:
        if r not in SUPPORTED:
            sec.row(recipe=r, opts={}, note="no Triton kernel (torch reference only)", ok=None)

    def bits(t):
        return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)

    n = ctx.args.quant_n or S["quant_n"]
    n -= n % 4096
    g = torch.Generator(device=dev).manual_seed(0)
    big = (torch.randn(n // 4096, 4096, generator=g, device=dev) *
           torch.exp(torch.randn(n // 4096, 1, generator=g, device=dev))).to(torch.bfloat16)
    nbytes = 2 * big.numel() * big.element_size()
    y = torch.empty_like(big)
    copy_ms = ctx.time_ms(lambda: y.copy_(big))
    copy_gbs = nbytes / copy_ms / 1e6
    sec.row(recipe="copy_", opts={}, dtype="torch.bfloat16", tensor=f"{n:,} elements", ms=copy_ms,
            gbs=copy_gbs, frac_of_copy=1.0, ok=None, info=True)
    for recipe, opts in QUANT_CASES:
        if sec.out_of_time(f"{recipe} {opts}"):
            return
        for dtype in (torch.float32, torch.bfloat16):
            okb, okm = True, True
            for seed in range(S["quant_seeds"]):
                x = _quant_edge_data(torch, seed, dtype, S["quant_edge"], dev)
                if "global_amax" in opts:
                    x = x.clamp(-3, 3)
                refx = fake_quant(x, recipe, **opts)
                out, mask = fake_quant_triton(x, recipe, clip_mask=True, **opts)
                okb &= out.dtype == x.dtype and _eq(bits(out), bits(refx))
                lo, hi = representable_range(quantize(x, recipe, **opts))
                okm &= _eq(mask.bool(), (x.float() >= lo) & (x.float() <= hi))
            sec.check(okb and okm, recipe=recipe, opts=opts, dtype=str(dtype),
                      tensor=f"edge cases {tuple(S['quant_edge'])} x{S['quant_seeds']} seeds",
                      bitwise_equal=bool(okb), mask_equal=bool(okm))
        xb = big.clamp(-3, 3) if "global_amax" in opts else big
        refx = fake_quant(xb, recipe, **opts)
        out = fake_quant_triton(xb, recipe, **opts)
        exact = _eq(bits(out), bits(refx))
        del refx, out
        ms = ctx.time_ms(lambda: fake_quant_triton(xb, recipe, **opts))
        gbs = nbytes / ms / 1e6
        sec.check(exact, recipe=recipe, opts=opts, dtype="torch.bfloat16", tensor=f"{n:,} elements",
                  bitwise_equal=exact, ms=ms, gbs=gbs, frac_of_copy=gbs / copy_gbs)


# ============================================================================ section: matmul_perf
def section_matmul_perf(sec: Section, ctx: Ctx):
    torch, dev, S = ctx.torch, ctx.device, ctx.S
    from skyrl_numerics.kernels import ops
    T = dict(backend="triton")
    dt = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*s):
        return torch.randn(*s, generator=g, device=dev).to(dt)

    def add(op, flops, ours, base, baseline, **shape):
        sec.row(op=op, dtype="torch.bfloat16", **shape, ours_ms=ours, base_ms=base,
                ours_tflops=flops / ours / 1e9, base_tflops=flops / base / 1e9,
                frac_of_base=base / ours, baseline=baseline, ok=None)

    blas = "cuBLAS" if dev == "cuda" else "CPU BLAS"
    Mmax = max(S["perf_ms"])
    for K in S["perf_kn"]:
        a_all = rnd(Mmax, K)
        for N in S["perf_kn"]:
            b = rnd(K, N)
            for M in S["perf_ms"]:
                if sec.out_of_time(f"matmul M={M} K={K} N={N}"):
                    return
                a = a_all[:M]
                ours = ctx.time_ms(lambda: ops.matmul(a, b, **T))
                base = ctx.time_ms(lambda: torch.matmul(a, b))
                add("matmul", 2 * M * K * N, ours, base, f"torch.matmul ({blas})", M=M, K=K, N=N)
    for B, M, K, N in S["perf_bmm"]:
        if sec.out_of_time(f"bmm B={B} M={M} K={K} N={N}"):
            return
        a, b = rnd(B, M, K), rnd(B, K, N)
        ours = ctx.time_ms(lambda: ops.bmm(a, b, **T))
        base = ctx.time_ms(lambda: torch.bmm(a, b))
        add("bmm", 2 * B * M * K * N, ours, base, f"torch.bmm ({blas})", B=B, M=M, K=K, N=N)
    for E, Tn, K, N in S["perf_grouped"]:
        if sec.out_of_time(f"grouped E={E} T={Tn} K={K} N={N}"):
            return
        x, w = rnd(Tn, K), rnd(E, K, N)
        ends = torch.linspace(Tn / E, Tn, E).round().to(torch.int32).to(dev)   # ~uniform routing
        offs = torch.cat([ends.new_zeros(1), ends]).to(torch.int64)
        ours = ctx.time_ms(lambda: ops.grouped_matmul(x, w, offs, **T))
        note = "grouped_matmul times include the public API's offsets check (one device-to-host copy)"
        if note not in sec.notes:
            sec.notes.append(note)
        try:
            torch._grouped_mm(x, w, offs=ends)
            base_fn, baseline = (lambda: torch._grouped_mm(x, w, offs=ends)), "torch._grouped_mm"
        except Exception as exc:  # noqa: BLE001 - older torch / unsupported arch
            sec.notes.append(f"torch._grouped_mm unavailable ({type(exc).__name__}); per-expert torch.mm loop")
            bounds = offs.tolist()
            base_fn = lambda: [x[bounds[e]:bounds[e + 1]] @ w[e] for e in range(E)]  # noqa: E731
            baseline = "per-expert torch.mm"
        base = ctx.time_ms(base_fn)
        add("grouped_matmul", 2 * Tn * K * N, ours, base, baseline, E=E, M=Tn, K=K, N=N)


# ============================================================================ section: attention_perf
def section_attention_perf(sec: Section, ctx: Ctx):
    torch, dev, S = ctx.torch, ctx.device, ctx.S
    import torch.nn.functional as F
    from skyrl_numerics.kernels import ops
    g = torch.Generator(device=dev).manual_seed(0)
    for B, H, Hkv, Sq, Skv, D in S["perf_attn"]:
        if sec.out_of_time(f"attention Sq={Sq} Skv={Skv}"):
            return
        q = torch.randn(B, H, Sq, D, generator=g, device=dev).to(torch.bfloat16)
        k = torch.randn(B, Hkv, Skv, D, generator=g, device=dev).to(torch.bfloat16)
        v = torch.randn(B, Hkv, Skv, D, generator=g, device=dev).to(torch.bfloat16)
        causal = Sq == Skv   # decode: one query over the whole cache, no mask needed
        ours = ctx.time_ms(lambda: ops.attention(q, k, v, causal=True, backend="triton"))
        # two SDPA baselines, the faster one is reported: native GQA, and K/V repeated to H heads
        # (repeat not timed), which every SDPA backend (flash included) accepts
        kr, vr = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
        bases = {"torch SDPA (K/V repeated to H heads)": ctx.time_ms(
            lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=causal))}
        try:
            bases["torch SDPA (enable_gqa=True)"] = ctx.time_ms(
                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True))
        except Exception as exc:  # noqa: BLE001 - older torch
            note = f"SDPA enable_gqa unavailable: {type(exc).__name__}"
            if note not in sec.notes:
                sec.notes.append(note)
        baseline = min(bases, key=bases.get)
        base = bases[baseline]
        sec.row(op="attention " + ("prefill" if causal else "decode"), B=B, H=H, Hkv=Hkv, Sq=Sq, Skv=Skv,
                D=D, ours_ms=ours, base_ms=base, frac_of_base=base / ours, baseline=baseline, ok=None)


SECTION_FNS = {"kernels": section_kernels, "mode": section_mode, "quant": section_quant,
               "matmul_perf": section_matmul_perf, "attention_perf": section_attention_perf}


# ============================================================================ output
def _fmt(v) -> str:
    if isinstance(v, bool) or v is None:
        return {True: "yes", False: "**no**", None: ""}[v]
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, dict):
        return ", ".join(f"{k}={x}" for k, x in v.items()) or "-"
    return str(v).replace("|", "/")


_MD_COLS = {
    "kernels": ["kernel", "dtype", "shape", "check", "ok", "max_rel_err", "tol", "detail"],
    "mode": ["target", "dtype", "check", "overridden", "ok", "detail"],
    "quant": ["recipe", "opts", "dtype", "tensor", "ok", "ms", "gbs", "frac_of_copy", "note"],
    "matmul_perf": ["op", "M", "K", "N", "E", "B", "ours_ms", "base_ms", "ours_tflops", "base_tflops",
                    "frac_of_base", "baseline"],
    "attention_perf": ["op", "B", "H", "Hkv", "Sq", "Skv", "D", "ours_ms", "base_ms", "frac_of_base",
                       "baseline"],
}


def to_markdown(res: dict) -> str:
    env = res["env"]
    title = env.get("device_name") or ("CPU" if res["dry_run"] else "no CUDA device")
    lines = [f"### GPU check: {title}"
             f"{' (DRY RUN: CPU, Triton interpreter, tiny shapes; timings meaningless)' if res['dry_run'] else ''}",
             "",
             f"Command: `{res['command']}`  ",
             f"python {env.get('python')}, torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), "
             f"triton {env.get('triton')}, transformers {env.get('transformers')}, "
             f"capability {env.get('capability')}, {env.get('sm_count')} SMs, import: {env.get('import_mode')}, "
             f"commit {env.get('git_commit')}  ",
             f"wall {res.get('wall_s', 0):.1f} s of a {res['budget_s']:.0f} s budget; sections: "
             + ", ".join(f"{k} **{v['status']}**" + (" (partial)" if v.get("partial") else "")
                         for k, v in res["sections"].items()),
             ""]
    for name, s in res["sections"].items():
        lines.append(f"#### {name}: {s['status']}{' (partial)' if s.get('partial') else ''}, {s.get('seconds', 0):.1f} s")
        for n in s.get("notes", []):
            lines.append(f"* {n}")
        if s.get("traceback"):
            lines += ["", "```", s["traceback"].strip()[-2000:], "```"]
        rows = s.get("rows", [])
        if rows:
            cols = [c for c in _MD_COLS.get(name, list(rows[0])) if any(c in r for r in rows)]
            lines += ["", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            for r in rows:
                cells = [_fmt(r.get(c)) for c in cols]
                if r.get("info"):
                    cells[0] = f"({cells[0]}, contrast)"
                lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def _atomic_write(path: Path, text: str):
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix="." + path.name)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class Results:
    def __init__(self, out: Path, header: dict):
        self.out, self.data, self.lock = out, header, threading.Lock()
        self.current: str | None = None

    def write(self):
        with self.lock:
            counts = {k: 0 for k in ("ok", "mismatch", "failed", "skipped", "timeout")}
            for s in self.data["sections"].values():
                counts[s["status"]] = counts.get(s["status"], 0) + 1
            self.data["summary"] = counts
            text = json.dumps(self.data, indent=1, default=str)
            md = to_markdown(self.data)
        _atomic_write(self.out / "gpu.json", text)
        _atomic_write(self.out / "gpu.md", md)


def _env(ctx_torch, import_mode: str, dry: bool) -> dict:
    torch = ctx_torch
    env = dict(python=platform.python_version(), platform=platform.platform(), torch=torch.__version__,
               torch_cuda=torch.version.cuda, import_mode=import_mode,
               triton_interpret=os.environ.get("TRITON_INTERPRET"), device="cpu" if dry else "cuda")
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception as exc:  # noqa: BLE001
        env["triton"] = f"not importable: {exc}"
    try:
        import transformers
        env["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001
        env["transformers"] = None
    if not dry and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(device_name=p.name, capability=f"sm_{p.major}{p.minor}", sm_count=p.multi_processor_count,
                   memory_gib=round(p.total_memory / 2**30, 1))
    if not dry:
        try:
            env["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                                                "--format=csv,noheader"], capture_output=True, text=True,
                                               timeout=20).stdout.strip() or None
        except Exception:  # noqa: BLE001
            env["nvidia_smi"] = None
    try:
        env["git_commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                           capture_output=True, text=True, timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001
        env["git_commit"] = None
    return env


# ============================================================================ main
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("out", nargs="?", default=None, help="output folder (default: $OUT, else ./gpu_check_out)")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for all sections (default 480)")
    p.add_argument("--grace", type=float, default=60.0,
                   help="watchdog: exit this long after the budget if a section hangs (default 60)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list from {','.join(SECTIONS)}")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU: re-run this script with TRITON_INTERPRET=1 (its env only) on tiny shapes")
    p.add_argument("--quant-n", type=int, default=None, help="elements of the large fake-quant tensor")
    imp = p.add_mutually_exclusive_group()
    imp.add_argument("--shim", dest="import_mode", action="store_const", const="shim",
                     help="always import through the path shim, even if installed")
    imp.add_argument("--install", dest="import_mode", action="store_const", const="install",
                     help="try pip install --no-deps --no-build-isolation --no-index -e . first")
    p.set_defaults(import_mode="auto")
    # for the tests of this script: make a section raise or hang (SECTION=raise|hang)
    p.add_argument("--inject", action="append", default=[], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    args.inject = dict(item.split("=", 1) for item in args.inject)
    bad = [s for s in args.sections if s not in SECTIONS]
    if bad:
        p.error(f"unknown section(s) {bad}; choose from {SECTIONS}")
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        # the interpreter must be chosen before triton is imported: a child process with it set
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        return subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv], env=env).returncode
    out = Path(args.out or os.environ.get("OUT") or "gpu_check_out").resolve()
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    budget = Budget(args.budget)
    import_mode = ensure_importable(args.import_mode)
    import warnings
    warnings.filterwarnings("ignore", message="invalid value encountered", category=RuntimeWarning)
    cmd = "python benchmarks/gpu_check.py " + " ".join(argv)
    try:
        import torch
    except Exception:  # noqa: BLE001 - nothing can run; still leave a gpu.json that says why
        _atomic_write(out / "gpu.json", json.dumps(dict(
            schema=SCHEMA, tool="benchmarks/gpu_check.py", command=cmd.strip(), dry_run=args.dry_run,
            exit_code=2, env=dict(python=platform.python_version(), import_mode=import_mode),
            error="import torch failed", traceback=traceback.format_exc(), sections={}), indent=1))
        print(f"gpu_check: import torch failed; wrote {out / 'gpu.json'}", file=sys.stderr)
        return 2
    header = dict(schema=SCHEMA, tool="benchmarks/gpu_check.py", command=cmd.strip(), dry_run=args.dry_run,
                  started_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                  budget_s=args.budget, wall_s=0.0, exit_code=None,
                  env=_env(torch, import_mode, args.dry_run), sections={})
    res = Results(out, header)
    if not args.dry_run and not torch.cuda.is_available():
        for name in args.sections:
            header["sections"][name] = dict(status="skipped", seconds=0.0, partial=False, rows=[],
                                            notes=["no CUDA device (use --dry-run on CPU)"])
        header["exit_code"] = 2
        res.write()
        print(f"no CUDA device; wrote {out / 'gpu.json'} (use --dry-run on a CPU machine)", file=sys.stderr)
        return 2
    ctx = Ctx(args, budget)

    def on_timeout():
        with res.lock:
            cur = res.current
            if cur is not None:
                s = header["sections"].setdefault(cur, dict(rows=[], notes=[], partial=True))
                s.update(status="timeout", seconds=time.monotonic() - s.pop("_t", t_start))
                s.setdefault("notes", []).append("watchdog: budget + grace exceeded inside this section")
            for name in args.sections:
                header["sections"].setdefault(name, dict(status="skipped", seconds=0.0, partial=False, rows=[],
                                                         notes=["not reached: watchdog exit"]))
            header["wall_s"] = time.monotonic() - t_start
            header["exit_code"] = 1
        try:
            res.write()
        finally:
            print(f"gpu_check: watchdog exit after {time.monotonic() - t_start:.0f} s", file=sys.stderr, flush=True)
            os._exit(1)
    dog = threading.Timer(max(budget.left(), 0.0) + args.grace, on_timeout)   # budget + grace from start
    dog.daemon = True
    dog.start()

    for i, name in enumerate(args.sections):
        shares_left = sum(SHARES[s] for s in args.sections[i:])
        sec = Section(name, ctx)
        rec = dict(status="skipped", seconds=0.0, partial=False, rows=sec.rows, notes=sec.notes)
        if budget.left() <= 0:
            sec.notes.append(f"skipped: the {args.budget:.0f} s budget was used up before this section")
            with res.lock:
                header["sections"][name] = rec
            res.write()
            print(f"[gpu_check] {name}: skipped (budget used up)", flush=True)
            continue
        slot = budget.start_section(SHARES[name], shares_left)
        t0 = time.monotonic()
        with res.lock:
            res.current = name
            rec["_t"] = t0
            header["sections"][name] = rec
        print(f"[gpu_check] {name}: start ({slot:.0f} s share, {budget.left():.0f} s left)", flush=True)
        try:
            if args.inject.get(name) == "raise":
                raise RuntimeError(f"injected failure in {name} (--inject)")
            while args.inject.get(name) == "hang":
                time.sleep(0.1)
            SECTION_FNS[name](sec, ctx)
            ctx.sync()
            bad = [r for r in sec.rows if r.get("ok") is False and not r.get("info")]
            status = "mismatch" if bad else "ok"
        except Exception:  # noqa: BLE001 - record, go on
            status = "failed"
            rec["traceback"] = traceback.format_exc()
            try:
                ctx.sync()
            except Exception:  # noqa: BLE001
                sec.notes.append("the device is unusable after this error; later sections will likely fail")
        with res.lock:
            rec.pop("_t", None)
            rec.update(status=status, seconds=time.monotonic() - t0, partial=sec.partial)
            res.current = None
            header["wall_s"] = time.monotonic() - t_start
        res.write()
        n_bad = sum(1 for r in sec.rows if r.get("ok") is False and not r.get("info"))
        print(f"[gpu_check] {name}: {status}{' (partial)' if sec.partial else ''} in "
              f"{rec['seconds']:.1f} s, {len(sec.rows)} rows, {n_bad} failing", flush=True)
        if name in ("matmul_perf", "attention_perf", "quant"):
            try:
                ctx.torch.cuda.empty_cache() if ctx.device == "cuda" else None
            except Exception:  # noqa: BLE001
                pass
    dog.cancel()
    bad = [n for n, s in header["sections"].items() if s["status"] in ("mismatch", "failed", "timeout")]
    code = 1 if bad else 0
    with res.lock:
        header["wall_s"] = time.monotonic() - t_start
        header["exit_code"] = code
    res.write()
    print(f"[gpu_check] wrote {out / 'gpu.json'} and {out / 'gpu.md'}; "
          f"{'problems in: ' + ', '.join(bad) if bad else 'no failures'}; {header['wall_s']:.1f} s", flush=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
