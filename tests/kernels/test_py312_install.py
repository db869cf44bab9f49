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


def _is_312(exe: str) -> str | None:
    """The real interpreter behind ``exe`` (a pyenv shim resolves to it) if it is Python 3.12."""
    try:
        out = subprocess.run([exe, "-c", "import sys; print(sys.version_info[:2] == (3, 12)); print(sys.executable)"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.split()
    return lines[1] if out.returncode == 0 and len(lines) == 2 and lines[0] == "True" else None


def _candidates():
    """``python3.12`` on PATH; each pyenv version 3.12.* (``pyenv prefix``); ``uv python find 3.12``."""
    if shutil.which("python3.12"):
        yield shutil.which("python3.12")
    pyenv = shutil.which("pyenv")
    if pyenv:
        vers = subprocess.run([pyenv, "versions", "--bare"], capture_output=True, text=True, timeout=60)
        for v in vers.stdout.split():
            if v.startswith("3.12"):
                pre = subprocess.run([pyenv, "prefix", v], capture_output=True, text=True, timeout=60)
                if pre.returncode == 0 and pre.stdout.strip():
                    yield str(Path(pre.stdout.strip()) / "bin" / "python3.12")
    uv = shutil.which("uv")
    if uv:
        found = subprocess.run([uv, "python", "find", "3.12"], capture_output=True, text=True, timeout=120)
        if found.returncode == 0 and found.stdout.strip():
            yield found.stdout.strip()


def _python312():
    for cand in _candidates():
        exe = _is_312(cand)
        if exe:
            return exe
    return None


def test_installs_into_python312_venv_without_deps(tmp_path):
    exe = _python312()
    if exe is None:
        pytest.skip("no Python 3.12 interpreter: not python3.12 on PATH, no pyenv 3.12.* version, "
                    "no 'uv python find 3.12'")
    env = dict(os.environ)
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
