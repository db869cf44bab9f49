"""benchmarks/gpu_check.py on CPU (--dry-run: its children run the ``gpu``-marked tests and GPU
benchmarks with TRITON_INTERPRET=1 and tiny shapes), so the GPU check is exercised on every
``make test``: every section ran tests and they passed, the rows cover the shared case lists, and
the budget / failure / timeout / not-installed paths behave. Each run is a subprocess; the script
sets TRITON_INTERPRET=1 only in its own children."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from device_cases import MODE_OPS, QUANT_IDS

pytestmark = [pytest.mark.triton]

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
SECTIONS = ["kernels", "mode", "quant", "matmul_perf", "attention_perf", "quant_perf"]
TOP = {"schema", "tool", "command", "dry_run", "started_at", "wall_s", "budget_s", "exit_code", "env",
       "sections", "summary"}
ENV_KEYS = {"python", "platform", "torch", "torch_cuda", "triton", "transformers", "skyrl_numerics", "device",
            "triton_interpret", "git_commit"}


def _env():
    return {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SKYRL_NUMERICS_GPU_DRY_RUN")}


def _run(out, *args, timeout=900, python=(sys.executable,), env=None):
    proc = subprocess.run([*python, str(SCRIPT), str(out), "--dry-run", *args], env=env or _env(),
                          capture_output=True, text=True, timeout=timeout)
    data = json.loads((out / "gpu.json").read_text()) if (out / "gpu.json").exists() else None
    return proc, data


@pytest.mark.slow
def test_dry_run_every_section_runs_its_tests_and_they_pass(tmp_path):
    # the default 480 s budget is the GPU's: on a loaded 2-core host the interpreted Triton kernels
    # section once took 93 s against its 91 s share (a fresh clone on three xdist workers), so the
    # dry run gets room; the budget and timeout paths are the tests below, with budgets they set
    proc, data = _run(tmp_path, "--budget", "1800", timeout=2400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert TOP <= set(data) and data["schema"] == 2 and data["dry_run"] is True and data["exit_code"] == 0
    assert ENV_KEYS <= set(data["env"]) and data["env"]["triton_interpret"] == "1"
    assert list(data["sections"]) == SECTIONS
    for name, sec in data["sections"].items():
        assert sec["status"] == "ok", (name, sec["notes"], [r for r in sec["rows"] if not r["ok"]][:3])
        assert sec["counts"]["passed"] > 0 and sec["counts"]["failed"] == sec["counts"]["error"] == 0, name
        assert len(sec["rows"]) == sum(sec["counts"].values()), name
        assert all(r["outcome"] == "passed" and r["ok"] is True for r in sec["rows"]), name
    assert data["summary"] == {"ok": 6, "mismatch": 0, "failed": 0, "skipped": 0, "timeout": 0}
    tests = {name: {r["test"] for r in sec["rows"]} for name, sec in data["sections"].items()}
    # the CPU tests' cases ran as the gpu (cuda) cases, plus the gpu-only ones
    assert "test_matmul_prefix_invariant_and_close[cuda]" in tests["kernels"]
    assert "test_attention_decode_equals_prefill_bitwise[2-2-37-cuda]" in tests["kernels"]
    assert {"test_rms_norm[cuda]", "test_attention[cuda]", "test_grouped_matmul[cuda]"} <= tests["kernels"]
    assert all(any(f"[{op}-" in t for t in tests["mode"]) for op in MODE_OPS)
    assert all(any(f"-{case}-cuda]" in t for t in tests["quant"]) for case in QUANT_IDS)
    assert all(any(f"large_tensor[{case}-cuda]" in t for t in tests["quant"]) for case in QUANT_IDS)
    errs = [r["max_rel_err"] for r in data["sections"]["kernels"]["rows"] if "max_rel_err" in r]
    assert errs and all(0 <= e <= 2e-2 for e in errs)
    for name in ("matmul_perf", "attention_perf"):
        assert all(r["ours_ms"] > 0 and r["base_ms"] > 0 and r["frac_of_base"] > 0 for r in data["sections"][name]["rows"])
    assert {r["op"] for r in data["sections"]["matmul_perf"]["rows"]} == {"matmul", "bmm", "grouped_matmul"}
    assert all(r["gbs"] > 0 and r["copy_gbs"] > 0 for r in data["sections"]["quant_perf"]["rows"])
    md = (tmp_path / "gpu.md").read_text()
    assert "DRY RUN" in md and "| test | outcome | seconds |" in md and "#### quant: ok" in md


def test_a_section_whose_pytest_dies_is_failed_and_the_next_one_runs(tmp_path):
    proc, data = _run(tmp_path, "--sections", "attention_perf,matmul_perf", "--inject", "attention_perf=fail")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    failed = data["sections"]["attention_perf"]
    assert failed["status"] == "failed" and failed["returncode"] == 3 and "pytest exited 3" in failed["notes"][0]
    assert data["sections"]["matmul_perf"]["status"] == "ok"
    assert data["summary"]["failed"] == 1 and data["exit_code"] == 1
    assert "#### attention_perf: failed" in (tmp_path / "gpu.md").read_text()


def test_spent_budget_skips_sections_with_a_note(tmp_path):
    proc, data = _run(tmp_path, "--budget", "0", "--sections", "kernels,quant")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for sec in data["sections"].values():
        assert sec["status"] == "skipped" and "budget" in sec["notes"][0]


def test_a_hung_section_is_stopped_at_its_share(tmp_path):
    # the budget counts from start-up (torch imported for env): leave enough to reach the section
    proc, data = _run(tmp_path, "--budget", "15", "--grace", "2", "--sections", "quant_perf",
                      "--inject", "quant_perf=hang", timeout=120)
    assert proc.returncode == 1
    sec = data["sections"]["quant_perf"]
    assert sec["status"] == "timeout" and "share of the budget" in sec["notes"][0]
    assert sec["seconds"] < 15 + 2 + 10


def test_without_the_package_it_says_so_and_exits_2(tmp_path):
    # python -S: no site-packages, so neither the installed package nor torch is importable
    env = {k: v for k, v in _env().items() if k != "PYTHONPATH"}
    proc, data = _run(tmp_path, python=(sys.executable, "-S"), env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "skyrl_numerics is not importable" in proc.stderr
    assert data["exit_code"] == 2 and all(s["status"] == "skipped" for s in data["sections"].values())
