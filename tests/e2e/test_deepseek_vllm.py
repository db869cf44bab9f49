"""The tiny DeepSeek-V3 (MLA latent attention, shared expert, sigmoid + bias group-limited
routing, dense first layer) on the real vLLM CPU engine: generation, route capture, gap."""
from __future__ import annotations

import numpy as np
import pytest

from skyrl_numerics.rollout.prompts import make_prompts
from skyrl_numerics.gap import measure
from skyrl_numerics.models import load_hf_model
from skyrl_numerics.trainer.logprobs import trainer_logprobs

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(deepseek_v3_dir):
    from skyrl_numerics.trainer import VLLMGenerator

    gen = VLLMGenerator(deepseek_v3_dir, capture_routes=True)
    yield gen
    gen.close()


def test_deepseek_v3_generates_captures_and_matches_trainer(engine, deepseek_v3_dir):
    ro = engine.generate(make_prompts(4, 16, engine.vocab_size, seed=1), max_tokens=32, seed=1)
    assert ro.num_response_tokens == 128
    # one MoE layer (layer 0 is dense), k = 2 of 8 routed experts
    assert engine.route_info["layer_ids"] == [1]
    assert ro.routes.num_layers == 1 and ro.routes.k == 2
    np.testing.assert_array_equal(ro.routes.seq_lens, ro.prompt_lens + ro.response_lens - 1)
    hf = load_hf_model(deepseek_v3_dir)
    for use_routes in (False, True):
        tl = trainer_logprobs(hf, ro, use_routes=use_routes)
        s = measure(tl.logprobs, ro.rollout_logprobs, cu_seqlens=ro.response_cu).summary()
        # measured: mean |Δ| 2.9e-2, max 0.11 (vLLM's absorbed-MLA kernels vs HF's MLA)
        assert 1e-4 < s["mean_abs"] < 0.1 and s["max_abs"] < 0.5, (use_routes, s)
