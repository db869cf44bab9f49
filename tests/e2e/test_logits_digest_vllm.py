"""The full distribution, bitwise: a digest of every sampled position's whole logits row, taken
inside the real vLLM CPU engine's worker (hook on its sampler), against the invariant trainer's
rows (gap/digest.py, ``invariant_logits_digest``). Nothing is mocked."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from skyrl_numerics.rollout.prompts import make_prompts
from skyrl_numerics.invariant.rollout_forward import invariant_logits_digest
from skyrl_numerics.invariant.qwen3_moe import InvariantQwen3Moe

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def trainer_model(qwen_moe_dir):
    return InvariantQwen3Moe.from_checkpoint(qwen_moe_dir)


@pytest.fixture(scope="module")
def engine(qwen_moe_dir):
    """The invariant engine with a 64-token step budget: long prompts are prefilled in chunks."""
    pytest.importorskip("vllm")
    from skyrl_numerics.trainer import VLLMGenerator

    gen = VLLMGenerator(qwen_moe_dir, batch_invariant=True, max_num_batched_tokens=64)
    yield gen
    gen.close()


def test_every_full_row_is_bitwise_under_chunked_prefill_prefix_hits_and_n2(engine, trainer_model):
    gen = engine
    shared = make_prompts(1, 150, gen.vocab_size, seed=41)[0]       # > 64: prefilled in chunks
    # seed=None: vLLM CPU 0.32 cannot combine per-request seeds with chunked prefill
    gen.generate([shared + [5, 6]], max_tokens=2, seed=None)         # warms the prefix cache
    prompts = [shared + t for t in make_prompts(2, 5, gen.vocab_size, seed=42)]
    prompts += make_prompts(2, 90, gen.vocab_size, seed=43)          # chunked, no cache hit
    ro = gen.generate(prompts, max_tokens=10, seed=None, n=2, temperature=0.8, logits_digest=True)
    assert min(ro.meta["num_cached_tokens"][:2]) >= 128, ro.meta["num_cached_tokens"]
    assert ro.logits_digest.digests.shape == (ro.num_response_tokens, 16)
    d = invariant_logits_digest(trainer_model, ro, batch_size=3)
    assert d["frac_bitwise"] == 1.0 and d["positions"] == ro.num_response_tokens, d
    assert d["first_mismatch"] is None
    # the hook is gone after the call: a plain call records nothing, the next one only its own
    assert gen.generate(prompts[:1], max_tokens=3, seed=None).logits_digest is None
    again = gen.generate(prompts[2:3], max_tokens=3, seed=None, logits_digest=True)
    assert len(again.logits_digest) == 3


def test_the_digest_is_of_the_raw_row_before_temperature(engine, trainer_model):
    """The first response position of a prompt has the same digest at any temperature (greedy
    included); the engine's recomputed row, divided by the temperature, gives the sampled token's
    processed logprob bit for bit (the row the sampler processed)."""
    gen = engine
    prompts = make_prompts(3, 9, gen.vocab_size, seed=44)
    runs = [gen.generate(prompts, max_tokens=4, seed=1, temperature=t, logits_digest=True)
            for t in (0.0, 0.7, 1.3)]
    firsts = [r.logits_digest.digests[r.response_cu[:-1]] for r in runs]
    assert all((f == firsts[0]).all() for f in firsts[1:])
    ro = runs[1]
    for pos in (0, 6):
        row = torch.from_numpy(gen.logits_row(ro, pos))
        lp = torch.log_softmax(row / 0.7, dim=-1)[int(ro.response_tokens[pos])]
        assert lp.item() == ro.rollout_logprobs[pos] and lp.dtype == torch.float32
    assert invariant_logits_digest(trainer_model, ro)["frac_bitwise"] == 1.0


def test_one_ulp_of_one_trainer_weight_is_found_and_the_token_named(engine, trainer_model):
    """lm_head[X, j] one bf16 ulp up in the trainer: only logit X can change, so the check is
    below 100 %, its first mismatch is the first position where the trainer's logit X changed,
    and the id it names (from the engine's recomputed row) is X."""
    gen = engine
    ro = gen.generate(make_prompts(4, 10, gen.vocab_size, seed=45), max_tokens=12, seed=2,
                      temperature=0.9, logits_digest=True)
    w = trainer_model.w("lm_head.weight")
    X = int(ro.response_tokens[3])
    j = int(w[X].float().abs().argmax())
    old = w[X, j].clone()

    def logit_x(i):   # the trainer's logit X at every response position of sequence i
        ids = torch.from_numpy(np.concatenate([ro.prompt(i), ro.response(i)]).astype(np.int64))
        p = int(ro.prompt_lens[i])
        with torch.no_grad():
            return trainer_model.logits(trainer_model.sequence_hidden(ids)[p - 1:-1]).float()

    before = [logit_x(i) for i in range(len(ro))]
    try:
        with torch.no_grad():
            w[X, j] = (old.view(torch.int16) + 1).view(torch.bfloat16)
        after = [logit_x(i) for i in range(len(ro))]
        d = invariant_logits_digest(trainer_model, ro, engine=gen)
    finally:
        with torch.no_grad():
            w[X, j] = old
    changed = np.concatenate([(a != b).any(-1).numpy() for a, b in zip(after, before)])
    only_x = all((a[:, np.arange(a.shape[1]) != X] == b[:, np.arange(a.shape[1]) != X]).all()
                 for a, b in zip(after, before))
    assert only_x and changed.any() and not changed.all(), changed
    assert d["frac_bitwise"] == pytest.approx(1 - changed.mean()) and d["frac_bitwise"] < 1
    fm = d["first_mismatch"]
    assert fm["position"] == int(np.argmax(changed)) and fm["token_id"] == X, fm
    i = int(np.searchsorted(ro.response_cu, fm["position"], side="right") - 1)
    t = fm["position"] - int(ro.response_cu[i])
    assert fm["engine_logit"] == before[i][t, X].item() and fm["trainer_logit"] == after[i][t, X].item()
    assert invariant_logits_digest(trainer_model, ro)["frac_bitwise"] == 1.0   # restored


def test_a_stock_engine_records_digests_and_the_check_reports_a_fraction(vllm_qwen, trainer_model):
    """vLLM's own Qwen3-MoE: its rows are not the invariant trainer's, but capture runs (with the
    route capture on the same engine) and the check reports a fraction and a first position; the
    token id is named only if the engine recomputes that row bit for bit, else it says why."""
    ro = vllm_qwen.generate(make_prompts(3, 8, vllm_qwen.vocab_size, seed=46), max_tokens=6,
                            seed=3, logits_digest=True)
    assert len(ro.logits_digest) == ro.num_response_tokens and ro.routes is not None
    d = invariant_logits_digest(trainer_model, ro, engine=vllm_qwen)
    assert d["positions"] == ro.num_response_tokens and 0.0 <= d["frac_bitwise"] <= 1.0
    fm = d["first_mismatch"]
    assert fm is not None and 0 <= fm["position"] < ro.num_response_tokens   # bf16 kernels differ
    assert isinstance(fm["token_id"], int) or "batch-invariant" in fm["token_id_unknown"], fm


def test_deepseek_mla_engine_full_rows_bitwise(vllm_deepseek_invariant, deepseek_v3_dir):
    """The invariant DeepSeek-V3 (absorbed MLA over its own latent cache): every row bitwise."""
    from skyrl_numerics.invariant import from_checkpoint

    gen = vllm_deepseek_invariant
    ro = gen.generate(make_prompts(3, 9, gen.vocab_size, seed=47), max_tokens=8, seed=4,
                      logits_digest=True)
    d = invariant_logits_digest(from_checkpoint(deepseek_v3_dir), ro, batch_size=2)
    assert d["frac_bitwise"] == 1.0 and d["positions"] == ro.num_response_tokens == 24, d


def test_seeded_requests_under_chunked_prefill_sample_what_an_unchunked_engine_samples(
        engine, vllm_qwen_invariant):
    """vLLM CPU undoes a chunked-prefill step's discarded draw with ``set_offset``, which a CPU
    generator refuses ("CPU Generator does not use offset": the engine dies). With our listed
    patch (``vllm_patches._rewindable_cpu_seeds``) the draw is undone instead: seeded requests
    whose prompts are prefilled in 64-token chunks sample exactly what the session's invariant
    engine (4096-token budget, nothing chunked) samples for the same seeds — the same logits on
    both (batch-invariant), so equal tokens need the same draws."""
    prompts = make_prompts(3, 150, engine.vocab_size, seed=44) + make_prompts(2, 20, engine.vocab_size, seed=45)
    chunked = engine.generate(prompts, max_tokens=8, seed=7, temperature=1.0)
    whole = vllm_qwen_invariant.generate(prompts, max_tokens=8, seed=7, temperature=1.0)
    assert np.array_equal(chunked.response_tokens, whole.response_tokens)
    assert np.array_equal(chunked.rollout_logprobs.view(np.uint32), whole.rollout_logprobs.view(np.uint32))
    alone = engine.generate(prompts[:1], max_tokens=8, seed=7, temperature=1.0)   # chunked, alone
    n = len(alone.response_tokens)
    assert np.array_equal(alone.response_tokens, chunked.response_tokens[:n])
