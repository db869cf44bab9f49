"""Our ``DeltaReceiver`` pointed at a store SkyRL 0.4.0's own ``DeltaCheckpointPublisher``
(``weight_sync/delta/checkpoint.py``, run on CPU: no trainer, rank 0) wrote: it refuses with the
layout it found and the one it expects, instead of applying 0 versions silently. (SkyRL's store is
read by ``sync.skyrl_receiver.SkyrlDeltaReceiver``: tests/integrations/test_skyrl_delta.py.)"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from skyrl_numerics.errors import InputError
from skyrl_numerics.sync.manifest import LAYOUT
from skyrl_numerics.sync.weight_sync import DeltaReceiver

DELTA = "backends.skyrl_train.weight_sync.delta.checkpoint"


def test_receiver_names_skyrls_store(skyrl, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    w = {"model.a.weight": torch.randn(8, 16).bfloat16(), "model.b.bias": torch.randn(16)}
    save_file(w, str(base / "model.safetensors"))
    pub = skyrl(DELTA).DeltaCheckpointPublisher(str(base), str(tmp_path / "sync"), str(tmp_path / "staging"),
                                                publish_num_workers=1)
    for _ in range(2):
        w = {k: v + 0.01 for k, v in w.items()}
        pub.publish(pub.create_delta_files(list(w.items())))
    m = json.loads((tmp_path / "sync" / "delta-00000002" / "manifest.json").read_text())
    assert m["version"] == 2 and m["base_version"] == 1 and len(m["tensors"]) == 2
    r = DeltaReceiver(tmp_path / "sync")
    for call in (r.sync, r.latest_version):
        with pytest.raises(InputError) as e:
            call()
        msg = str(e.value)
        assert "SkyRL checkpoint-delta store (delta-%08d/manifest.json, 2 version(s): " \
               "delta-00000001/manifest.json" in msg, msg
        assert f"expected {LAYOUT}" in msg and e.value.field == "root"
    assert r.version is None and r.state == {}
