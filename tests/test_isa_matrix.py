"""Every invariance claim (tests marked ``isa``) under each CPU capability below this host's.

The parent pytest runs those tests at the host's own ISA like any other test. Here one child
pytest per lower capability runs them again with torch, MKL and oneDNN capped there (the
variables below), so an AVX-512 host also shows what an AVX2 host (and a machine without any
vector unit torch uses) would: a bitwise claim that holds only for the ISA it was written on
fails here. The child checks that the cap took effect before anything else (a cap torch does
not take would make the run meaningless). The C kernels (``kernels/csrc``) are built for the
host and are IEEE-exact anyway (``-ffp-contract=off``; a baseline ``-O2`` build is tested to give
the same bits), so they are not rebuilt per capability.

The real vLLM engine is in it too (``tests/e2e/test_batch_invariant_vllm.py``: engine vs trainer,
every token bitwise): its worker processes inherit the caps, so torch's ops there run the lower
ISA as well (the test checks the worker's reported capability); vLLM's own kernel library is
chosen from the CPU itself, not from these caps. Under ``default`` the engine does not start
(measured: vLLM's torch.compile'd sampler fails in inductor's C++ codegen without a vector ISA,
``vec_reduce_all<int64_t, 2>``), so there the vLLM tests are left out of the child.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CAPS = {   # ATEN_CPU_CAPABILITY -> (MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA)
    "default": ("SSE4_2", "SSE41"),
    "avx2": ("AVX2", "AVX2"),
    "avx512": ("AVX512", "AVX512_CORE"),
}
_ORDER = ["default", "avx2", "avx512"]
CHILD = "SKYRL_NUMERICS_ISA_CHILD"


def isa_env(cap: str) -> dict[str, str]:
    mkl, onednn = CAPS[cap]
    return {"ATEN_CPU_CAPABILITY": cap, "MKL_ENABLE_INSTRUCTIONS": mkl, "ONEDNN_MAX_CPU_ISA": onednn}


def files_with_isa_claims() -> list[Path]:
    """This file (its first test checks that the cap took effect) and every test file that marks a
    claim ``isa`` (a module ``pytestmark`` or a test's mark): the child collects only these, not
    the whole suite it would deselect anyway."""
    here = Path(__file__).resolve()
    return [here] + sorted(p for p in (REPO / "tests").rglob("test_*.py")
                           if p.resolve() != here and "pytest.mark.isa" in p.read_text())


def lower_capabilities() -> list[str]:
    """The capabilities below this process's (``torch.backends.cpu.get_cpu_capability()``)."""
    here = torch.backends.cpu.get_cpu_capability().lower()
    here = "avx512" if here.startswith("avx512") else here
    return _ORDER[:_ORDER.index(here)] if here in _ORDER else []


@pytest.mark.isa
def test_this_process_reports_its_capability():
    cap = torch.backends.cpu.get_cpu_capability()
    want = os.environ.get("ATEN_CPU_CAPABILITY")
    if want:                     # a child (or a user's capped run): the cap took effect
        assert cap.lower() == want.lower(), f"ATEN_CPU_CAPABILITY={want} but torch runs {cap}"
    assert cap in ("DEFAULT", "AVX2", "AVX512", "ZVECTOR", "VSX", "SVE256") or cap.startswith("AVX512")


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get(CHILD) == "1", reason="already the capped child")
@pytest.mark.parametrize("cap", lower_capabilities() or [pytest.param("none", marks=pytest.mark.skip(
    reason=f"no capability below this host's ({torch.backends.cpu.get_cpu_capability()}) to emulate"))])
def test_invariance_claims_hold_under_a_lower_capability(cap, tmp_path):
    env = {**os.environ, **isa_env(cap), CHILD: "1"}
    log = tmp_path / f"isa-{cap}.log"
    marks = "isa and not vllm" if cap == "default" else "isa"      # (module doc: vLLM under default)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marks,
           "--rootdir", str(REPO), "-x", *map(str, files_with_isa_claims())]
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, env=env, cwd=str(REPO), stdout=fh, stderr=subprocess.STDOUT, timeout=1800)
    text = log.read_text()
    tail = "\n".join(text.splitlines()[-40:])
    assert proc.returncode == 0, f"under ATEN_CPU_CAPABILITY={cap} (rc {proc.returncode}):\n{tail}"
    assert " passed" in tail and " failed" not in tail, tail
