"""`skyrl-numerics doctor` against the real vLLM CPU engine: table, report.json, PNG."""
from __future__ import annotations

import json

import pytest

from skyrl_numerics.cli import main

pytestmark = pytest.mark.vllm


def test_doctor_writes_ablation_report(tmp_path, vllm_qwen, capsys):
    out = tmp_path / "doctor"
    rc = main(["doctor", "--prompts", "4", "--max-tokens", "24", "--out", str(out),
               "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "vllm (cpu) 0.32.0" in printed and "baseline" in printed
    rep = json.loads((out / "report.json").read_text())
    assert rep["engine"] == "vllm (cpu)" and rep["engine_version"] == "0.32.0"
    rows = {r["name"]: r for r in rep["rows"]}
    base = rows["baseline: HF trainer, bf16"]["summary"]
    assert base["n_tokens"] == 4 * 24 and 0 < base["mean_abs"] < 0.05
    # top-p/top-k sampling with a full-vocab trainer: every token is off by log(kept mass) > 0
    trunc = rows["top-p/top-k: HF trainer, full-vocab"]["summary"]
    assert trunc["mean_abs"] > 10 * base["mean_abs"]
    # support replay removes that bias: back to the baseline's order of magnitude
    replay = rows["top-p/top-k: + support replay"]["summary"]
    assert replay["mean_abs"] < 5 * base["mean_abs"] and replay["F_2"] == 0.0
    assert (out / "gap.png").read_bytes()[:4] == b"\x89PNG"
