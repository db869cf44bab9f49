"""`skyrl-numerics train --backend megatron`: the GRPO loop with the megatron-core trainer (one rank), real vLLM
generator, delta sync of the weights gathered from the trainer's shards; the same OUT/train.json history as FSDP."""
from __future__ import annotations

import json

import pytest

from skyrl_numerics.cli import main

pytestmark = [pytest.mark.vllm, pytest.mark.megatron, pytest.mark.slow]
pytest.importorskip("megatron.core")


def _run(tmp_path, backend):
    out = tmp_path / backend
    assert main(["train", "--backend", backend, "--configs", "aligned", "--steps", "2", "--prompts", "2",
                 "--samples", "4", "--max-tokens", "8", "--out", str(out), "--no-progress"]) == 0
    return json.loads((out / "train.json").read_text())


def test_train_backend_megatron_same_history_as_fsdp(tmp_path, vllm_qwen):
    mg, fs = _run(tmp_path, "megatron"), _run(tmp_path, "fsdp")
    assert mg["settings"]["backend"] == "megatron" and fs["settings"]["backend"] == "fsdp"
    a, b = mg["history"]["aligned"], fs["history"]["aligned"]
    assert len(a) == len(b) == 2
    for ra, rb in zip(a, b):
        assert set(ra) == set(rb)  # the same per-step record
        assert 0 < ra["sync_payload_bytes"] < ra["sync_raw_bytes"] and ra["sync_version"] >= 1
        assert ra["grad_cos_onpolicy"] > 0.99, ra  # R3 + support replay: close to the on-policy gradient
    # step 0: same checkpoint, same seeded rollout: the two trainers see the same gap (fp32 trainers differ
    # by ~1e-6 in logprob, the gap is ~1e-3)
    assert a[0]["reward"] == b[0]["reward"]
    assert a[0]["gap_mean_abs"] == pytest.approx(b[0]["gap_mean_abs"], rel=0.02)
    assert a[0]["loss"] == pytest.approx(b[0]["loss"], rel=1e-3, abs=1e-6)


def test_train_backend_megatron_refuses_unmapped_family(tmp_path):
    assert main(["train", "--backend", "megatron", "--family", "deepseek_v3", "--configs", "aligned",
                 "--steps", "1", "--out", str(tmp_path / "x"), "--no-progress"]) == 2
