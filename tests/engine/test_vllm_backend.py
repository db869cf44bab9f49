"""The skyrl_delta backend's checks that need no engine: init/update info parsing and the served
layout (the real-server tests are tests/e2e/test_server_sync.py)."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from skyrl_numerics.errors import InputError  # noqa: E402
from skyrl_numerics.engine.transfer_backend import (SkyrlDeltaInitInfo, SkyrlDeltaUpdateInfo,
                                                    _typed, served_layout)


def test_served_layout_reads_headers(qwen_moe_dir):
    from safetensors.torch import load_file

    layout = served_layout(str(qwen_moe_dir))
    real = load_file(str(qwen_moe_dir / "model.safetensors"))
    assert set(layout) == set(real)
    for k, t in real.items():
        assert layout[k].device.type == "meta"
        assert (layout[k].dtype, tuple(layout[k].shape)) == (t.dtype, tuple(t.shape))


def test_served_layout_refuses_what_it_cannot_read(tmp_path):
    with pytest.raises(InputError, match="cannot find the served checkpoint"):
        served_layout("no-such-org/no-such-model-xyz")
    with pytest.raises(InputError, match="has no \\*.safetensors"):
        served_layout(str(tmp_path))


@pytest.mark.parametrize("d, match", [
    ({"store": "/x", "extra": 1}, "unknown key 'extra'"),
    ({"store": ""}, "non-empty"),
    ({"store": 3}, "non-empty"),
    ({}, "store"),
    ([], "must be a JSON object"),
    ({"store": "/x", "max_bytes": -1}, "non-negative"),
    ({"store": "/x", "max_bytes": True}, "non-negative"),
])
def test_init_info_is_checked(d, match):
    with pytest.raises(InputError, match=match):
        _typed(SkyrlDeltaInitInfo, d, "init_info")


def test_update_info_is_checked():
    assert _typed(SkyrlDeltaUpdateInfo, {"version": 3}, "update_info").version == 3
    assert _typed(SkyrlDeltaUpdateInfo, {}, "update_info").version is None
    for bad in ({"version": -1}, {"version": 1.0}, {"version": "2"}, {"tensors": []}):
        with pytest.raises(InputError):
            _typed(SkyrlDeltaUpdateInfo, bad, "update_info")


def test_a_store_of_another_layout_is_named(tmp_path):
    """The server-side receiver: a store holding SkyRL's layout is refused naming it (before, an
    empty version list: "no version published")."""
    from skyrl_numerics.engine.transfer_backend import SkyrlDeltaEngine
    from skyrl_numerics.sync.weight_sync import DeltaReceiver

    (tmp_path / "delta-00000001").mkdir()
    (tmp_path / "delta-00000001" / "manifest.json").write_text("{}")
    eng = SkyrlDeltaEngine.__new__(SkyrlDeltaEngine)   # no engine: only its version chain
    eng.receiver, eng.store, eng._high_water = DeltaReceiver(tmp_path), str(tmp_path), {}
    with pytest.raises(InputError, match="found a SkyRL checkpoint-delta store .* expected manifests/"):
        eng._chain(None)
