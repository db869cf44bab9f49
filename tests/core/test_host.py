"""skyrl_numerics.host: the host's ISA, the vLLM CPU kernel build it loads and what that build can
run (probed in a subprocess, no engine), and the doctor's capability skips (stand-in engines)."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from skyrl_numerics import host
from skyrl_numerics.errors import InputError

W4A16_AVX2 = ("vLLM CPU build _C_AVX2 (host ISA AVX2; assumed: SKYRL_NUMERICS_ASSUME_VLLM_BUILD) "
              "has no cpu_gemm_wna16: no INT4 W4A16 kernel")


@pytest.fixture
def no_caps(monkeypatch):
    """No answers cached in this process, no assumed build; vLLM with its x86 libraries."""
    pytest.importorskip("vllm")
    libs = {p.name.split(".")[0] for p in host._vllm_dir().glob("_C*.so")}
    if not {"_C", "_C_AVX512", "_C_AVX2"} <= libs:
        pytest.skip(f"this vLLM install has kernel libraries {sorted(libs)}, not the x86 three")
    monkeypatch.setattr(host, "_CAPS", {})
    monkeypatch.delenv(host.ASSUME_ENV, raising=False)
    return monkeypatch


@pytest.fixture
def fresh(no_caps, tmp_path):
    """Nor on disk: the probes really load the libraries (a subprocess each)."""
    no_caps.setenv("SKYRL_NUMERICS_CACHE_DIR", str(tmp_path))
    return no_caps


def _vllm_rule() -> str:
    """vllm/platforms/cpu.py ``import_kernels``, written out independently of the probe."""
    import torch

    if platform.machine() not in ("x86_64", "AMD64"):
        return "_C"
    if torch.cpu._is_avx512_supported():
        return "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"
    return "_C_AVX2"


def test_host_info_is_json_and_names_the_isa(monkeypatch):
    import torch

    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    h = json.loads(json.dumps(host.host_info()))
    assert h["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert set(h["isa_flags"]) == set(host.FLAGS) and h["isa"] == host.isa_name(h["isa_flags"])
    assert h["isa_caps"] == {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert h["torch"] == torch.__version__ and h["cpu_model"]
    assert host.isa_name(dict(avx2=True, fma=True)) == "AVX2"
    assert host.isa_name(dict(avx2=True, avx512f=True, avx512_bf16=True, amx_tile=True)) == "AVX512+BF16+AMX"


def test_capped_torch_shows_in_host_info_and_as_a_mismatch():
    """A process with ATEN_CPU_CAPABILITY=default (what an engine started under another cap, or
    on another machine, reports) differs from this one: the warning names the field."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    out = subprocess.run([sys.executable, "-c", "import json; from skyrl_numerics.host import "
                          "host_info; print(json.dumps(host_info()))"], env=env,
                         capture_output=True, text=True, check=True).stdout
    other, mine = json.loads(out.splitlines()[-1]), host.host_info()
    assert other["torch_cpu_capability"] == "DEFAULT" and other["isa_caps"]["ATEN_CPU_CAPABILITY"] == "default"
    assert host.isa_mismatch(mine, dict(mine, pid=1)) is None
    warn = host.isa_mismatch(mine, other)
    assert warn.startswith("warning: trainer and engine run different CPU ISAs")
    assert "torch_cpu_capability" in warn and "'DEFAULT'" in warn
    rep = host.host_report(mine, [None, dict(mine, pid=1), other])
    assert rep["isa_mismatch"] is True and rep["isa_warning"] == warn
    assert rep["host"] is mine and rep["engine_host"]["pid"] == 1
    assert host.host_report(mine, [])["isa_mismatch"] is False
    assert host.isa_mismatch(mine, {"error": "no skyrl_host_info"}) is None


def test_this_hosts_build_is_vllms_choice_and_has_w4a16(fresh):
    """The probe runs vLLM's own import_kernels; its choice is the rule written out here, and on
    an AVX-512 host that build (_C) has the W4A16 kernel."""
    pytest.importorskip("vllm")
    caps = host.vllm_capabilities()
    assert "error" not in caps, caps
    assert caps["build"] == _vllm_rule() and caps["decided_by"] == "vLLM CpuPlatform.import_kernels"
    w = caps["features"]["w4a16"]
    assert w["ok"] is (caps["build"] != "_C_AVX2") and w["needs_ops"] == ["cpu_gemm_wna16"]
    if caps["build"] == "_C":
        assert host.missing_kernel_reason("w4a16") is None
        assert all(f["ok"] for f in caps["features"].values()) == host.isa_flags()["amx_tile"]
    assert host.vllm_capabilities() is caps   # cached per process


def test_avx2_build_loaded_explicitly_has_no_w4a16(fresh):
    pytest.importorskip("vllm")
    fresh.setenv(host.ASSUME_ENV, "_C_AVX2")
    caps = host.vllm_capabilities()
    assert caps["build"] == "_C_AVX2" and caps["host_isa"] == "AVX2", caps
    assert 0 < caps["n_ops"] and caps["features"]["w4a16"]["missing_ops"] == ["cpu_gemm_wna16"]
    assert host.missing_kernel_reason("w4a16") == W4A16_AVX2
    assert host.served_formats()["cpu_mla"] is True          # the reference MLA decode is there
    assert "needs avx512f or amx_tile" in host.missing_kernel_reason("fp8_kv_cache")
    fresh.setenv(host.ASSUME_ENV, "_C")                      # the AVX-512 BF16 library, explicitly
    full = host.vllm_capabilities()
    if not host.isa_flags()["avx512f"]:
        # an AVX2 host cannot even load it: the probe's SIGILL is reported, never a crash, and
        # no kernel counts as present
        assert full["error"].startswith("kernel probe exited -4: illegal instruction"), full
        assert full["features"]["w4a16"]["ok"] is None and full["n_ops"] == 0
        return
    assert full["features"]["w4a16"]["ok"] is True and full["n_ops"] > caps["n_ops"]
    fresh.setenv(host.ASSUME_ENV, "_C_AVX512")
    assert host.vllm_capabilities()["features"]["w4a16"]["ok"] is True


def test_bad_assumed_build_and_feature_are_input_errors(fresh):
    fresh.setenv(host.ASSUME_ENV, "_C_SSE")
    with pytest.raises(InputError, match="SKYRL_NUMERICS_ASSUME_VLLM_BUILD.*expected one of _C, "):
        host.vllm_capabilities()
    fresh.delenv(host.ASSUME_ENV)
    with pytest.raises(InputError, match="unknown vLLM feature 'int3'"):
        host.missing_kernel_reason("int3")


# ---- the doctor: INT4 engine rows on a build without W4A16 --------------------------------------
INT4_ROWS = ["engine runs INT4 kernels: plain trainer", "engine runs INT4 kernels: + fake-quant matched"]


class FakeEngine:
    started: list = []

    def __init__(self, model_dir, **kw):
        import numpy as np

        from skyrl_numerics.engine.generator import EngineInfo

        FakeEngine.started.append(str(model_dir))
        self.vocab_size, self.info, self.llm = 512, EngineInfo("fake", "0"), object()
        self.np = np
        mine = host.host_info()["torch_cpu_capability"]
        # an engine whose torch runs another capability than the trainer's
        self.engine_host = dict(host.host_info(), pid=-1,
                                torch_cpu_capability="DEFAULT" if mine != "DEFAULT" else "AVX2")

    def generate(self, prompts, *, max_tokens, seed=0, **kw):
        from skyrl_numerics.rollout import Rollout

        rng = self.np.random.default_rng(seed)
        resp = [rng.integers(2, 512, size=max_tokens).tolist() for _ in prompts]
        return Rollout.from_lists(prompts, resp, [[-6.2] * max_tokens for _ in prompts],
                                  engine="fake", engine_version="0", meta={"tokens_per_s": 1.0})

    def close(self):
        pass


def test_doctor_skips_int4_rows_without_the_kernel_and_exits_0(no_caps, fake_engines, qwen_moe_dir,
                                                               tmp_path, capsys):
    pytest.importorskip("vllm")
    from skyrl_numerics import doctor
    from skyrl_numerics.cli import main

    from skyrl_numerics.doctor.model_check import inspect_checkpoint

    ctx = doctor.DoctorContext(model_dir=qwen_moe_dir, family="qwen3_moe",
                               info=inspect_checkpoint(qwen_moe_dir, count_params=False))
    rows = {r.name: r for r in doctor.ROWS}
    if host.missing_kernel_reason("w4a16") is None:     # this host's own build runs them
        assert all(doctor.skip_reason(rows[n], ctx) is None for n in INT4_ROWS)
    no_caps.setenv(host.ASSUME_ENV, "_C_AVX2")
    assert all(doctor.skip_reason(rows[n], ctx) == W4A16_AVX2 for n in INT4_ROWS)

    FakeEngine.started = []
    fake_engines(FakeEngine)
    out = tmp_path / "doc"
    rc = main(["doctor", "--no-progress", "--verbose", "--prompts", "2", "--prompt-len", "4",
               "--max-tokens", "3", "--out", str(out),
               *[a for r in ["baseline: HF trainer, bf16", *INT4_ROWS] for a in ("--row", r)]])
    printed = capsys.readouterr().out
    assert rc == 0
    assert FakeEngine.started == [str(qwen_moe_dir)]      # the stock engine only: no INT4 one
    rep = json.loads((out / "report.json").read_text())
    st = {r["name"]: r["status"] for r in rep["rows"]}
    assert st["baseline: HF trainer, bf16"] == "measured"
    assert all(st[n] == f"skipped: {W4A16_AVX2}" for n in INT4_ROWS), st
    # the host is recorded: the trainer's ISA and kernel build, the engine's own report, and the
    # stand-in engine's other torch capability flagged (warning line printed, isa_mismatch true)
    assert rep["host"]["torch_cpu_capability"] == host.host_info()["torch_cpu_capability"]
    assert rep["host"]["vllm_kernels"]["build"] == "_C_AVX2"
    assert rep["engine_host"]["pid"] == -1 and rep["isa_mismatch"] is True
    assert rep["isa_warning"].startswith("warning: trainer and engine run different CPU ISAs")
    assert "warning: trainer and engine run different CPU ISAs" in printed


def test_qat_check_says_which_formats_this_host_serves(no_caps, tmp_path, capsys):
    pytest.importorskip("vllm")
    from skyrl_numerics.cli import main
    from skyrl_numerics.models import build_tiny_model
    from skyrl_numerics.quant import write_quantized_checkpoint

    src = build_tiny_model("qwen3_moe", cache_dir=tmp_path / "m", num_hidden_layers=1)
    for fmt in ("ct_int4", "ct_nvfp4"):
        write_quantized_checkpoint(src, tmp_path / fmt, fmt, lambda n: ".experts." in n)
    no_caps.setenv(host.ASSUME_ENV, "_C_AVX2")
    assert main(["qat-check", str(tmp_path / "ct_int4"), "--json", str(tmp_path / "r.json")]) == 0
    text = capsys.readouterr().out
    assert f"serving int4_g32 on this host's vLLM CPU (_C_AVX2): no: {W4A16_AVX2}" in text
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["cpu_serving"] == {"int4_g32": W4A16_AVX2} and rep["vllm_cpu_build"] == "_C_AVX2"
    no_caps.setenv(host.ASSUME_ENV, "_C")
    assert main(["qat-check", str(tmp_path / "ct_int4")]) == 0
    assert "serving int4_g32 on this host's vLLM CPU (_C): yes" in capsys.readouterr().out
    assert main(["qat-check", str(tmp_path / "ct_nvfp4")]) == 0
    assert "no NVFP4 linear kernel on CPU (any build)" in capsys.readouterr().out


def test_engine_memory_share_reads_the_environment_and_refuses_a_bad_value(monkeypatch):
    """The share of RAM an engine started without a memory setting reserves on CPU: 0.1, or
    $SKYRL_NUMERICS_CPU_MEMORY_SHARE; what serve and VLLMGenerator pass as gpu_memory_utilization."""
    from skyrl_numerics.engine.server import serve_command
    from skyrl_numerics.models import build_tiny_model

    monkeypatch.delenv(host.CPU_MEMORY_SHARE_ENV, raising=False)
    assert host.cpu_memory_share() == 0.1
    monkeypatch.setenv(host.CPU_MEMORY_SHARE_ENV, "0.25")
    assert host.cpu_memory_share() == 0.25
    if not host.on_gpu():
        argv = serve_command(build_tiny_model("qwen3_moe"))
        assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.25"
    for bad in ("0", "1.5", "-0.1", "nan", "a tenth"):
        monkeypatch.setenv(host.CPU_MEMORY_SHARE_ENV, bad)
        with pytest.raises(InputError, match=host.CPU_MEMORY_SHARE_ENV) as e:
            host.cpu_memory_share()
        assert e.value.field == host.CPU_MEMORY_SHARE_ENV
