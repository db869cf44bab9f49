"""atomic.py: the one way files and folders are written so that no reader sees half of one."""
from __future__ import annotations

import pytest

from skyrl_numerics.atomic import atomic_dir, atomic_file, atomic_files


def test_file_renamed_on_success_and_removed_on_error(tmp_path):
    target = tmp_path / "a" / "x.json"
    with atomic_file(target) as tmp:
        assert tmp.parent == target.parent and not target.exists()
        tmp.write_text("1")
    assert target.read_text() == "1"
    with pytest.raises(RuntimeError), atomic_file(target) as tmp:
        tmp.write_text("2")
        raise RuntimeError
    assert target.read_text() == "1" and sorted(p.name for p in target.parent.iterdir()) == ["x.json"]


def test_files_none_renamed_before_all_written(tmp_path):
    names = ["b.json", "a.png", "c.md"]
    with pytest.raises(RuntimeError), atomic_files([tmp_path / n for n in names]) as tmps:
        tmps[0].write_text("b")
        raise RuntimeError
    assert list(tmp_path.iterdir()) == []
    with atomic_files([tmp_path / n for n in names]) as tmps:
        for n, t in zip(names, tmps):
            t.write_text(n)
        assert list(tmp_path.glob("[!.]*")) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)
    assert all((tmp_path / n).read_text() == n for n in names)


def test_a_failed_rename_removes_the_temps_left(tmp_path):
    (tmp_path / "dir.json").mkdir()          # a file cannot replace a folder
    (tmp_path / "dir.json" / "keep").write_text("")
    with pytest.raises(OSError), atomic_files([tmp_path / "first", tmp_path / "dir.json",
                                               tmp_path / "last"]):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.json", "first"]


def test_dir_keeps_an_existing_copy_unless_replace(tmp_path):
    target = tmp_path / "ckpt"
    with atomic_dir(target) as tmp:
        (tmp / "w").write_text("1")
    with atomic_dir(target) as tmp:          # content-addressed: the first copy stays
        (tmp / "w").write_text("2")
    assert (target / "w").read_text() == "1"
    with atomic_dir(target, replace=True) as tmp:
        (tmp / "w").write_text("3")
    assert (target / "w").read_text() == "3"
    with pytest.raises(RuntimeError), atomic_dir(target, replace=True) as tmp:
        (tmp / "w").write_text("4")
        raise RuntimeError
    assert (target / "w").read_text() == "3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
