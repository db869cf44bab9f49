"""Attribution of the DeepSeek-V3 gap on the real vLLM CPU engine (docs/mla.md): emulating vLLM
CPU's rotary kernel on MLA's 3-D q/k views in the trainer (with the batch layout the engine
recorded) removes most of the gap; the MLA formulation and MoE numerics are small next to it."""
from __future__ import annotations

import pytest

from skyrl_numerics.rollout.prompts import make_prompts
from skyrl_numerics.gap import measure
from skyrl_numerics.models import load_hf_model
from skyrl_numerics.trainer.logprobs import trainer_logprobs

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(deepseek_v3_dir):
    from skyrl_numerics.trainer import VLLMGenerator
    from skyrl_numerics.doctor.mla_attribution import EXTENSION

    gen = VLLMGenerator(deepseek_v3_dir, capture_routes=True, worker_extension_cls=EXTENSION)
    yield gen
    gen.close()


@pytest.fixture(scope="module")
def rollout_and_steps(engine):
    from skyrl_numerics.doctor.mla_attribution import recorded_steps

    engine.generate([[2, 3]], max_tokens=2)  # warm-up: its steps must be dropped
    ro = engine.generate(make_prompts(6, 16, engine.vocab_size, seed=2), max_tokens=32, seed=2)
    return ro, recorded_steps(engine, ro)


def _mean_abs(model, ro, **kw):
    tl = trainer_logprobs(model, ro, **kw)
    return measure(tl.logprobs, ro.rollout_logprobs, cu_seqlens=ro.response_cu).summary()


def test_recorded_steps_cover_every_fed_token(rollout_and_steps):
    ro, steps = rollout_and_steps
    fed = {}
    for step in steps:
        assert len({row for row, _, _ in step}) == len(step)
        for row, start, n in step:
            for p in range(start, start + n):
                fed[(row, p)] = fed.get((row, p), 0) + 1
    want = {(i, p) for i in range(len(ro))
            for p in range(int(ro.prompt_lens[i] + ro.response_lens[i]) - 1)}
    assert set(fed) == want and set(fed.values()) == {1}


def test_cpu_rope_emulation_explains_most_of_the_gap(rollout_and_steps, deepseek_v3_dir):
    from skyrl_numerics.doctor.mla_attribution import vllm_style_hook

    ro, steps = rollout_and_steps
    hf = load_hf_model(deepseek_v3_dir)
    base = _mean_abs(hf, ro)
    rope = _mean_abs(hf, ro, forward_hook=vllm_style_hook(hf, ro, ["cpu_rope"], steps=steps))
    full = _mean_abs(hf, ro, use_routes=True,
                     forward_hook=vllm_style_hook(hf, ro, ["cpu_rope", "mla", "router", "moe",
                                                           "mlp"], steps=steps))
    # measured (doctor, 8 x 64): baseline 3.3e-2 -> 3.4e-3 with the rotary kernel emulated ->
    # 2.7e-3 with every piece and R3; a conservative bound here
    assert base["mean_abs"] > 1e-2, base
    assert rope["mean_abs"] < base["mean_abs"] / 4, (base, rope)
    assert full["mean_abs"] < base["mean_abs"] / 4, (base, full)
    assert full["max_abs"] < base["max_abs"], (base, full)
