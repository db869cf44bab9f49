"""A receiver pointed at a store it cannot read says so: the layout it found and the one it expects
(before, ``sync()`` applied nothing and returned ``[]``). An empty or missing root, or one holding
only our own folders (a publish under way), is no error: nothing is published yet. SkyRL's own
publisher writes the SkyRL layout in tests/integrations/test_skyrl_weight_sync.py; here a
minimal faithful copy of it (``delta-%08d/manifest.json`` + its payload file name)."""
from __future__ import annotations

import json

import fsspec
import pytest
import torch

from skyrl_numerics.errors import InputError
from skyrl_numerics.sync.manifest import LAYOUT, foreign_layout
from skyrl_numerics.sync.store import SyncStore
from skyrl_numerics.sync.weight_sync import DeltaPublisher, DeltaReceiver

SKYRL_MANIFEST = {"version": 1, "base_version": 0, "tensors": [], "total_uncompressed_num_bytes": 0,
                  "total_compressed_num_bytes": 0, "payload_files": ["delta-rank00000-file000000.safetensors"]}


def _skyrl_store(root):
    for v in (1, 2):
        d = root / f"delta-{v:08d}"
        d.mkdir(parents=True)
        (d / "manifest.json").write_text(json.dumps({**SKYRL_MANIFEST, "version": v, "base_version": v - 1}))
        (d / "delta-rank00000-file000000.safetensors").write_bytes(b"")


def _refused(root, *needles):
    r = DeltaReceiver(root)
    for call in (r.sync, r.latest_version):
        with pytest.raises(InputError) as e:
            call()
        msg = str(e.value)
        assert e.value.field == "root" and "\n" not in msg
        assert f"expected {LAYOUT}" in msg, msg
        for n in needles:
            assert n in msg, msg
    return msg


def test_nothing_published_yet_is_no_error(tmp_path):
    for root in (tmp_path / "missing", tmp_path):
        r = DeltaReceiver(root)
        assert r.sync() == [] and r.latest_version() is None
    (tmp_path / "payloads" / "000000000000").mkdir(parents=True)   # a publish under way
    (tmp_path / ".DS_Store").write_bytes(b"")                       # hidden files are not content
    assert DeltaReceiver(tmp_path).sync() == []


def test_a_skyrl_store_is_named(tmp_path):
    _skyrl_store(tmp_path)
    _refused(tmp_path, "a SkyRL checkpoint-delta store", "delta-%08d/manifest.json",
             "2 version(s): delta-00000001/manifest.json", str(tmp_path))


def test_a_sharded_store_and_unknown_content_are_named(tmp_path):
    (tmp_path / "s" / "versions").mkdir(parents=True)
    (tmp_path / "s" / "links" / "s0-d0").mkdir(parents=True)
    _refused(tmp_path / "s", "sharded store", "ShardedReceiver")
    (tmp_path / "u").mkdir()
    (tmp_path / "u" / "notes.txt").write_text("x")
    (tmp_path / "u" / "delta-1").mkdir()                             # not SkyRL's %08d, no manifest
    _refused(tmp_path / "u", "2 entries of no weight-sync layout known here (delta-1, notes.txt")


def test_fsspec_store_and_our_own_layout(tmp_path):
    url = "memory://skyrl-layout-test/run"
    fs = fsspec.filesystem("memory")
    fs.pipe_file("/skyrl-layout-test/run/delta-00000001/manifest.json", json.dumps(SKYRL_MANIFEST).encode())
    try:
        assert "SkyRL checkpoint-delta store" in foreign_layout(SyncStore(url))
        _refused(url, "delta-00000001/manifest.json")
    finally:
        fs.rm("/skyrl-layout-test", recursive=True)
    pub = DeltaPublisher(tmp_path / "ours")
    pub.publish({"w": torch.arange(6, dtype=torch.float32)})
    assert foreign_layout(SyncStore(tmp_path / "ours")) is None
    assert [m.version for m in DeltaReceiver(tmp_path / "ours").sync()] == [0]
