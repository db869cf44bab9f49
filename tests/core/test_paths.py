"""One cache folder, one variable: the kernels, the tiny checkpoints and the host probes all live
under ``paths.cache_dir()``."""
from __future__ import annotations

from pathlib import Path

from skyrl_numerics import host, models, paths
from skyrl_numerics.kernels import native


def test_the_variable_then_the_old_name_then_xdg_then_home(monkeypatch, tmp_path):
    for var in (paths.CACHE_ENV, paths.OLD_CACHE_ENV, "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert paths.cache_dir() == tmp_path / "home" / ".cache" / "skyrl_numerics"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert paths.cache_dir("models") == tmp_path / "xdg" / "skyrl_numerics" / "models"
    monkeypatch.setenv(paths.OLD_CACHE_ENV, str(tmp_path / "old"))
    assert paths.cache_dir() == tmp_path / "old"
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path / "new"))
    assert paths.cache_dir() == tmp_path / "new"


def test_every_cache_reads_it(monkeypatch, tmp_path):
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path))
    assert native.cache_dir() == tmp_path
    assert native.library_path().parent == tmp_path
    assert models.default_cache_dir() == tmp_path / "models"
    assert Path(host._cache_path({"k": 1})).parent == tmp_path / "host"
