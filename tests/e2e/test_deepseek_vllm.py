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


def test_trace_hf_against_stock_vllm_names_a_first_divergence(engine, deepseek_v3_dir):
    """The layer-by-layer tracer on this engine: HF's MLA and vLLM's absorbed MLA read the same
    embedding, first RMSNorm and projections, and part in the attention core of layer 0."""
    from skyrl_numerics.doctor.trace import Side, run_trace

    r = run_trace(deepseek_v3_dir, ["hf", Side("vllm", model=engine)], per_op=True,
                  keep_tensors=True)
    by = {m.name: m for m in r.comparison.modules}
    assert r.first is not None and r.first.name == "L0.attn_core", r.table()
    for name in ("embed", "L0.attn_norm", "L0.q", "L0.kv_a"):
        assert by[name].status == "equal", name
    assert by["L1.router_logits"].rows == 64 and by["logits"].rows == 4
    assert r.first.max_abs_delta > 0 and r.comparison.growth[-1].name == "logits"
