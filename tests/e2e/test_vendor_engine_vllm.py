"""The real vLLM CPU engine serving vendor-quantized checkpoints through the invariant model
(invariant/vendor_plan.py): vLLM's own quantization switched off, the stored codes + scales
loaded by the invariant model, and the trainer's ``from_checkpoint`` of the same directory giving
every sampled token's logprob, every route and every full logits row bit for bit.

Checkpoints: compressed-tensors INT4 W4A16 g32 on attention + experts (``write_int4_checkpoint``),
modelopt NVFP4 W4A4 with static input scales (modelopt's own HF export, when it runs here),
DeepSeek-V3 block FP8 with per-token 1x128 FP8 activations (MLA, shared experts, a dense layer)."""
from __future__ import annotations

import numpy as np
import pytest
import vendor_ckpts as V     # tests/vendor_ckpts.py (tests/ is on the path: its conftest)

from skyrl_numerics.rollout.prompts import make_prompts
from skyrl_numerics.invariant import from_checkpoint
from skyrl_numerics.invariant.rollout_forward import invariant_logits_digest
from skyrl_numerics.trainer.logprobs import invariant_trainer_logprobs

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.filterwarnings("ignore")]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, qwen_moe_dir):
    from skyrl_numerics.models import build_tiny_model
    from skyrl_numerics.engine.serving_checkpoint import write_int4_checkpoint

    root = tmp_path_factory.mktemp("vendor_e2e")
    ds = build_tiny_model("deepseek_v3", q_lora_rank=128, moe_intermediate_size=128)
    out = {"ct_int4": (write_int4_checkpoint(qwen_moe_dir, experts=True, out_dir=root / "int4e"), qwen_moe_dir,
                       1024),
           "deepseek_fp8": (V.ours(ds, root / "dsfp8", "deepseek_fp8"), ds, 1024)}
    mo = V.modelopt_export(root, algos=("NVFP4_DEFAULT_CFG",))
    if mo is not None:
        d = mo["NVFP4_DEFAULT_CFG"]
        out["modelopt_nvfp4"] = (d, d.with_name(d.name + ".base"), 128)     # (its tiny model: 128 positions)
    return out


@pytest.mark.parametrize("kind", ["ct_int4", "modelopt_nvfp4", "deepseek_fp8"])
def test_engine_and_trainer_serve_the_vendor_checkpoint_bitwise(ckpts, kind):
    pytest.importorskip("vllm")
    from skyrl_numerics.trainer import VLLMGenerator

    if kind not in ckpts:
        pytest.skip(f"modelopt's export does not run here (its dependencies are not in {V.DEPS})")
    d, base, max_len = ckpts[kind]
    gen = VLLMGenerator(d, batch_invariant=True, capture_routes=True, max_model_len=max_len)
    try:
        prompts = make_prompts(6, 12, gen.vocab_size, seed=7)
        ro = gen.generate(prompts, temperature=1.0, max_tokens=24, seed=0, logits_digest=True)
        ro2 = gen.generate(prompts[:2] + [prompts[0][:5] + [9, 9]], temperature=0.8, top_p=0.9, top_k=16,
                           max_tokens=16, seed=3, capture_support=True)       # prefix-cache hits, a support
    finally:
        gen.close()
    m = from_checkpoint(d)
    tl = invariant_trainer_logprobs(m, ro, return_routes=True, batch_size=3)
    assert np.array_equal(tl.logprobs.view(np.uint32), ro.rollout_logprobs.view(np.uint32))
    assert np.array_equal(tl.routes.values, ro.routes.values)
    dg = invariant_logits_digest(m, ro)
    assert dg["frac_bitwise"] == 1.0, dg
    tl2 = invariant_trainer_logprobs(m, ro2, use_support=True)
    assert np.array_equal(tl2.logprobs.view(np.uint32), ro2.rollout_logprobs.view(np.uint32))
    if base is not None:        # the quantized numbers are live: the bf16 model gives others
        plain = invariant_trainer_logprobs(from_checkpoint(base), ro)
        assert not np.array_equal(plain.logprobs, ro.rollout_logprobs)
        print(f"{kind}: {len(ro.rollout_logprobs)} tokens bitwise; bf16 base vs served: mean |d| "
              f"{np.abs(plain.logprobs - ro.rollout_logprobs).mean():.3g}")
