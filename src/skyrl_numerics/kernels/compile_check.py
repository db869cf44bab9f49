"""Compile every Triton kernel for Hopper (sm_90) and Blackwell (sm_100) without a GPU.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", cap, 32))`` runs the whole pipeline
(TTIR -> TTGIR -> LLVM -> PTX -> ptxas cubin). Registers and spill bytes come from
``ptxas -v`` (shipped with Triton) on the kernel's PTX; shared memory from Triton's metadata. Must run WITHOUT TRITON_INTERPRET.

    python -m skyrl_numerics.kernels.compile_check          # markdown table on stdout
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

ARCHS = (90, 100)


@dataclass
class CompileResult:
    name: str
    arch: int
    ok: bool
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    shared_bytes: int | None = None
    error: str = ""


def all_specs():
    from . import tl_attention, tl_matmul, tl_reduce, tl_rmsnorm, tl_softmax
    specs = []
    for mod in (tl_matmul, tl_softmax, tl_rmsnorm, tl_reduce, tl_attention):
        specs.extend(mod.compile_specs())
    return specs


def _ptxas(arch: int) -> str | None:
    import triton
    d = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):   # the newer one reads the PTX version Triton emits
        if os.path.exists(os.path.join(d, name)):
            return os.path.join(d, name)
    return None


def _resource_usage(ptx: str, arch: int) -> dict:
    """Registers and spill bytes as ``ptxas -v`` reports them for the kernel's PTX."""
    tool = _ptxas(arch)
    m = re.search(r"^\.target\s+(sm_\w+)", ptx, re.M)
    if tool is None or m is None:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        proc = subprocess.run([tool, "-v", f"--gpu-name={m.group(1)}", path, "-o",
                               os.path.join(tmp, "k.cubin")], capture_output=True, text=True, timeout=120)
    text = proc.stdout + proc.stderr
    out = {}
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if regs:
        out["registers"] = int(regs.group(1))
    if spill:
        out["spill_stores"], out["spill_loads"] = int(spill.group(1)), int(spill.group(2))
    return out


def compile_one(name, fn, signature, constexprs, num_warps, arch) -> CompileResult:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = dict(signature)
    for k in constexprs:
        sig[k] = "constexpr"
    try:
        src = ASTSource(fn=fn, signature=sig, constexprs=dict(constexprs))
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": num_warps, "num_stages": 3})
        cubin = compiled.asm.get("cubin")
        if not cubin:
            return CompileResult(name, arch, False, error="no cubin")
        return CompileResult(name, arch, True, shared_bytes=compiled.metadata.shared,
                             **_resource_usage(compiled.asm["ptx"], arch))
    except Exception as exc:  # reported, not raised: the table shows every kernel
        return CompileResult(name, arch, False, error=f"{type(exc).__name__}: {str(exc)[:300]}")


def check_all(archs=ARCHS) -> list[CompileResult]:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("run the compile check without TRITON_INTERPRET")
    return [compile_one(*spec, arch) for spec in all_specs() for arch in archs]


def markdown(results: list[CompileResult]) -> str:
    lines = ["| kernel | arch | compiled | registers/thread | spill stores (B) | spill loads (B) | shared (B) |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.name} | sm_{r.arch} | {'yes' if r.ok else 'NO: ' + r.error} | "
                     f"{r.registers} | {r.spill_stores} | {r.spill_loads} | {r.shared_bytes} |")
    return "\n".join(lines)


if __name__ == "__main__":
    res = check_all()
    print(markdown(res))
    sys.exit(0 if all(r.ok for r in res) else 1)
