"""The package installs into a Python 3.12 virtual environment (``--no-deps``: no torch download)
and its torch-free modules and console script work there. Skipped where no Python 3.12 exists.
(GPU machines run Python 3.12; ``requires-python`` allows 3.11-3.13.)"""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def _python312():
    env = {**os.environ, "PYENV_VERSION": os.environ.get("PYENV_VERSION", "3.12.1")}
    for cand in ("python3.12", str(Path.home() / ".pyenv" / "versions" / "3.12.1" / "bin" / "python3.12")):
        exe = shutil.which(cand) or (cand if Path(cand).exists() else None)
        if not exe:
            continue
        try:
            out = subprocess.run([exe, "-c", "import sys; print(sys.version_info[:2])"], env=env,
                                 capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip() == "(3, 12)":
            return exe, env
    return None, env


def test_installs_into_python312_venv_without_deps(tmp_path):
    exe, env = _python312()
    if exe is None:
        pytest.skip("no Python 3.12 interpreter here")
    venv = tmp_path / "v312"
    subprocess.run([exe, "-m", "venv", str(venv)], env=env, check=True, timeout=300)
    py = venv / "bin" / "python"
    src = tmp_path / "src"   # a copy without build outputs, so the build leaves the checkout alone
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".cache", "artifacts", "build", "*.egg-info", "__pycache__", ".hypothesis"))
    proc = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(src)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    code = ("import sys, skyrl_numerics, skyrl_numerics.errors, skyrl_numerics.atomic, skyrl_numerics.cli; "
            "assert sys.version_info[:2] == (3, 12); "
            "assert 'torch' not in sys.modules; print(skyrl_numerics.__version__)")
    out = subprocess.run([str(py), "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "0.1.0"
    cli = subprocess.run([str(venv / "bin" / "skyrl-numerics"), "--help"], env=env, capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert cli.returncode == 0 and "doctor" in cli.stdout, cli.stderr[-2000:]
