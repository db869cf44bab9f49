"""The hub's Qwen3.5 checkpoints (``Qwen3_5MoeForConditionalGeneration``: ``text_config`` with
M-RoPE sections + ``vision_config``, weights ``model.language_model.*`` / ``model.visual.*``),
text only, bitwise between the real vLLM CPU engine and the trainer.

The engine runs the invariant text family (``engine/vllm_invariant_model.py``), not vLLM's own
multimodal Qwen3.5 (whose module needs torchvision): no vision tower, no M-RoPE positions.
The checkpoint is saved by transformers 5.19's own multimodal class; its text-only twin (the same
weights as ``Qwen3_5MoeForCausalLM``) gives the trainer the same bits. Nothing is mocked. One
engine, opt-in like the text families' (``SKYRL_NUMERICS_HYBRID_ALL=1``); the default suite runs
the trainer side and vLLM's own config of it (tests/invariant/test_qwen3_5_multimodal.py).
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from qwen3_5_hub import MROPE, build_pair
from skyrl_numerics.invariant import from_checkpoint
from skyrl_numerics.invariant.rollout_forward import invariant_logits_digest
from skyrl_numerics.rollout.prompts import make_prompts
from skyrl_numerics.trainer.logprobs import invariant_trainer_logprobs

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("SKYRL_NUMERICS_HYBRID_ALL", "") != "1",
                                 reason="one engine more: set SKYRL_NUMERICS_HYBRID_ALL=1")]


@pytest.fixture(scope="module")
def hub_engine(tmp_path_factory):
    """``(engine, hub trainer, text-only trainer)`` of the tiny hub-layout Qwen3.5-MoE."""
    pytest.importorskip("vllm")
    from skyrl_numerics.trainer import VLLMGenerator

    hub, txt = build_pair(tmp_path_factory.mktemp("q35vl"), "qwen3_5_moe", torch.bfloat16,
                          **MROPE)
    gen = VLLMGenerator(hub, batch_invariant=True, capture_routes=True,
                        max_num_batched_tokens=64)
    yield gen, from_checkpoint(hub), from_checkpoint(txt)
    gen.close()


def test_every_token_route_and_logits_row_is_the_trainers(hub_engine):
    """Seven requests decoding together (two prefilled in chunks of the 64-token budget): every
    sampled token's logprob, every route and every full logits row is the trainer's, from the
    hub checkpoint and from its text-only twin, at trainer batch sizes 1 and 3."""
    gen, hub_trainer, text_trainer = hub_engine
    prompts = make_prompts(5, 30, gen.vocab_size, seed=1) + make_prompts(2, 100, gen.vocab_size,
                                                                         seed=2)
    ro = gen.generate(prompts, max_tokens=16, seed=None, temperature=0.8, logits_digest=True)
    assert ro.routes is not None
    for trainer in (hub_trainer, text_trainer):
        for bs in (1, 3):
            tl = invariant_trainer_logprobs(trainer, ro, batch_size=bs, return_routes=True)
            bad = np.flatnonzero(tl.logprobs != ro.rollout_logprobs)
            assert len(bad) == 0, f"batch {bs}: {len(bad)}/{len(tl.logprobs)} tokens differ"
            assert tl.routes == ro.routes
        digest = invariant_logits_digest(trainer, ro, batch_size=4)
        assert digest["frac_bitwise"] == 1.0, digest


def test_the_doctors_bitwise_row_on_the_hub_checkpoint(tmp_path, capfd):
    """``doctor --model HUB_DIR`` with the batch-invariant row: the checkpoint is read as its
    language model (text_config, ``model.language_model.*``) and the row is 100 % bitwise."""
    from skyrl_numerics.cli import main

    hub, _ = build_pair(tmp_path, "qwen3_5_moe", torch.bfloat16, **MROPE)
    out, row = tmp_path / "out", "+ batch-invariant (trainer and vLLM)"
    assert main(["doctor", "--model", str(hub), "--prompts", "4", "--max-tokens", "8",
                 "--out", str(out), "--no-progress", "--row", row]) == 0, capfd.readouterr().err
    rep = json.loads((out / "report.json").read_text())
    assert rep["model"]["architecture"] == "Qwen3_5MoeForConditionalGeneration"
    (inv,) = [r for r in rep["rows"] if r["name"] == row]
    assert inv["status"] == "measured" and inv["summary"]["frac_bitwise_equal"] == 1.0, inv
