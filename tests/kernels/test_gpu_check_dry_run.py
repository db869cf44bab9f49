"""benchmarks/gpu_check.py on CPU (--dry-run: Triton interpreter, tiny shapes), so the GPU check
script is exercised on every run: every section passes, the output format is stable, and the
budget / failure / watchdog paths behave. Each run is a subprocess; the script sets
TRITON_INTERPRET=1 only in its own child process."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.triton]

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
SECTIONS = ["kernels", "mode", "quant", "matmul_perf", "attention_perf"]
ENV_KEYS = {"python", "platform", "torch", "torch_cuda", "triton", "transformers", "device",
            "import_mode", "triton_interpret", "git_commit"}


def _run(out, *args, timeout=900):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}   # the script sets it
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), "--dry-run", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)
    data = json.loads((out / "gpu.json").read_text()) if (out / "gpu.json").exists() else None
    return proc, data


def test_dry_run_all_sections_pass_through_the_path_shim(tmp_path):
    proc, data = _run(tmp_path, "--shim")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert data["schema"] == 1 and data["dry_run"] is True and data["exit_code"] == 0
    assert ENV_KEYS <= set(data["env"])
    assert data["env"]["import_mode"] == "shim" and data["env"]["triton_interpret"] == "1"
    assert list(data["sections"]) == SECTIONS
    for name, sec in data["sections"].items():
        assert sec["status"] == "ok", (name, sec.get("notes"), sec.get("traceback"))
        assert sec["rows"], name
        assert {"status", "seconds", "partial", "notes", "rows"} <= set(sec)
        assert all("ok" in r for r in sec["rows"])
    assert data["summary"] == {"ok": 5, "mismatch": 0, "failed": 0, "skipped": 0, "timeout": 0}
    rows = data["sections"]
    checks = {(r["kernel"], r["check"]) for r in rows["kernels"]["rows"] if not r.get("info")}
    for kernel in ("matmul", "bmm", "grouped_matmul", "log_softmax", "token_logprob_entropy",
                   "rms_norm", "mean", "sum", "attention"):
        assert any(k == kernel for k, _ in checks), kernel
    assert ("attention", "decode_equals_prefill") in checks
    assert ("rms_norm backward dW", "bitwise_vs_ordered_reference") in checks
    ops = {r["target"] for r in rows["mode"]["rows"]}
    assert {"aten.mm", "aten.addmm", "aten.bmm", "aten._grouped_mm", "aten._log_softmax",
            "aten._softmax", "aten.mean.dim"} <= ops
    assert any("MoE" in t or "Moe" in t for t in ops)
    quant = [r for r in rows["quant"]["rows"] if r.get("bitwise_equal") is not None]
    assert {r["recipe"] for r in quant} == {"fp8_block", "mxfp8", "mxfp4", "nvfp4"}
    assert all(r["bitwise_equal"] for r in quant)
    perf = rows["matmul_perf"]["rows"]
    assert {r["op"] for r in perf} == {"matmul", "bmm", "grouped_matmul"}
    assert all(r["ours_ms"] > 0 and r["base_ms"] > 0 and r["ok"] is None for r in perf)
    md = (tmp_path / "gpu.md").read_text()
    assert "DRY RUN" in md and "| kernel | dtype | shape | check |" in md and "#### quant: ok" in md


def test_failing_section_is_recorded_and_the_next_one_runs(tmp_path):
    proc, data = _run(tmp_path, "--sections", "matmul_perf,attention_perf", "--inject", "matmul_perf=raise")
    assert proc.returncode == 1
    failed = data["sections"]["matmul_perf"]
    assert failed["status"] == "failed" and "injected failure" in failed["traceback"]
    assert data["sections"]["attention_perf"]["status"] == "ok"
    assert "#### matmul_perf: failed" in (tmp_path / "gpu.md").read_text()


def test_spent_budget_skips_sections_with_a_note(tmp_path):
    proc, data = _run(tmp_path, "--budget", "0", "--sections", "kernels,quant")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for sec in data["sections"].values():
        assert sec["status"] == "skipped" and "budget" in sec["notes"][0]


def test_watchdog_writes_results_when_a_section_hangs(tmp_path):
    # the budget counts from start-up (imports included): leave enough to reach the section
    proc, data = _run(tmp_path, "--budget", "15", "--grace", "1", "--sections", "matmul_perf,attention_perf",
                      "--inject", "matmul_perf=hang")
    assert proc.returncode == 1
    assert data["sections"]["matmul_perf"]["status"] == "timeout"
    assert data["sections"]["attention_perf"]["status"] == "skipped"
    assert "watchdog" in data["sections"]["matmul_perf"]["notes"][-1]


def test_gpu_quant_wrapper_cpu_smoke_writes_its_json(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(SCRIPT.parent / "gpu_quant.py"), "--cpu-smoke",
                           "--out", str(tmp_path / "out"), "--json", str(tmp_path / "q.json")],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    q = json.loads((tmp_path / "q.json").read_text())
    assert q["status"] == "ok" and q["copy_gbs"] > 0
    assert all(r["bitwise_equal"] for r in q["rows"] if "bitwise_equal" in r)
