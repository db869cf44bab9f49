"""The test-only framework installs (Makefile): the pinned releases import from their side folders,
and a run without them says so instead of passing."""
import importlib.metadata
import importlib.util
import subprocess
import sys

import pytest

from framework_paths import PINS, framework_dir


def test_skyrl_release_imports_from_its_folder(skyrl):
    fp8 = skyrl("backends.skyrl_train.weight_sync.fp8.quantize")
    assert "/frameworks/skyrl/" in fp8.__file__
    assert importlib.metadata.version("skyrl") == PINS["skyrl"]


@pytest.mark.slow
def test_trl_release_imports_in_a_child_process(trl_env):
    code = "import trl; from trl import GRPOTrainer; print(trl.__version__, trl.__file__)"
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=trl_env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    version, path = out.stdout.split()[-2:]
    assert version == PINS["trl"] and "/frameworks/trl/" in path
    assert importlib.util.find_spec("trl") is None          # this process does not see it


@pytest.mark.parametrize("name", sorted(PINS))
def test_a_missing_folder_skips_naming_it(tmp_path, name):
    with pytest.raises(pytest.skip.Exception, match=f"{name}=={PINS[name]} is not installed in "
                       f"{tmp_path / name} \\(it is missing\\): run `make venv`"):
        framework_dir(name, root=tmp_path)
    (tmp_path / name / f"{name}-0.0.1.dist-info").mkdir(parents=True)
    with pytest.raises(pytest.skip.Exception, match=f"it holds {name}-0.0.1.dist-info"):
        framework_dir(name, root=tmp_path)
