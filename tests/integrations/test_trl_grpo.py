"""TRL 1.16's own ``GRPOTrainer`` code under ``batch_invariant_mode(strict=True)`` and
``integrations.trl.add_position_ids`` is bitwise per sequence: logprobs across TRL's micro-batch
splits (4, 2, 1) and left padding, and each sequence's input-embedding gradient of TRL's loss across
splits (4, 2+2) — in fp32, TRL's bf16 autocast, with gradient checkpointing, and on the model
``torch.compile``d the way ``Trainer`` does (``accelerator.prepare_model``). Without the shim the
left-padded batch differs; with the MoE load-balancing loss on, gradients differ (by definition).
One child process runs every configuration (``trl_grpo_shim_child.py``; it prints one JSON line).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from framework_paths import framework_dir

pytestmark = pytest.mark.slow
CHILD = Path(__file__).with_name("trl_grpo_shim_child.py")
SHIMMED = ["fp32", "fp32_checkpointing", "bf16_autocast", "bf16_autocast_checkpointing", "fp32_compiled"]


@pytest.fixture(scope="module")
def runs() -> dict:
    env = dict(os.environ)      # as conftest.py's trl_env (module scope here: one child for the file)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(framework_dir("trl")), env.get("PYTHONPATH")) if p)
    env["SKYRL_NUMERICS_MODE_STRICT"] = "1"
    res = subprocess.run([sys.executable, str(CHILD)], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", SHIMMED)
def test_logprobs_and_per_sequence_gradients_are_bitwise_with_the_shim(runs, name):
    r = runs[name]
    assert r["checked"] == 12 and r["grads_checked"] == 8 and r["finite_nonzero"], r
    assert r["logps_differing"] == 0 and r["grads_differing"] == 0, (name, r)


def test_the_configurations_are_what_they_say(runs):
    assert runs["compiled_type"] == "OptimizedModule"
    assert runs["checkpointing_on"] == {"fp32_checkpointing": True, "bf16_autocast_checkpointing": True}


def test_without_the_shim_the_left_padded_batch_differs(runs):
    r = runs["fp32_no_shim"]
    assert r["logps_differing"] > 0 and r["grads_differing"] > 0, r


def test_the_moe_load_balancing_loss_couples_the_sequences(runs):
    r = runs["fp32_router_aux_loss"]
    assert r["logps_differing"] == 0 and r["grads_differing"] > 0, r
