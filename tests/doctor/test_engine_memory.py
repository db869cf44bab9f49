"""engine_memory: the bytes of an engine of a checkpoint (weights, KV cache, overhead) against
hand-computed values for a Qwen3-MoE-like and a DeepSeek-V3-like config, properties of the
arithmetic, and the plan of which doctor rows run together, alone or not at all, with a faked
free-memory number (psutil) and the doctor's engines as stand-ins."""
from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from skyrl_numerics.doctor import engine_memory as em
from skyrl_numerics.errors import InputError


@pytest.fixture(autouse=True)
def _default_engine_share(monkeypatch):
    """These tests model the engines' default share of RAM (0.1): without the suite's smaller one
    (tests/conftest.py)."""
    monkeypatch.delenv("SKYRL_NUMERICS_CPU_MEMORY_SHARE", raising=False)

GiB = 1 << 30
QWEN3 = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
             num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_hidden_layers=2,
             vocab_size=151936, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=768)
DSV3 = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=2048,
            num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
            qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, num_hidden_layers=2,
            vocab_size=163840, n_routed_experts=64, num_experts_per_tok=6)


# ---- the arithmetic, by hand ------------------------------------------------------------------
def test_kv_layout_qwen3_moe_by_hand():
    # GQA: 2 (K and V) x 4 kv heads x 128 head dim x 2 B (bf16) = 2048 B per token and layer
    lay = em.kv_layout(QWEN3, dtype="bfloat16")
    assert (lay.kind, lay.layers, lay.token_bytes, lay.block_size) == ("gqa", 2, 2048, 128)
    assert em.kv_layout(QWEN3, dtype="float32").token_bytes == 4096
    assert em.kv_layout(QWEN3, kv_cache_dtype="fp8").token_bytes == 1024   # vLLM's FP8 cache
    # the invariant model: its row (2048 B) in slots of 2 x ceil(2048 / 256) x 64 x 2 B = 2048 B
    assert em.kv_layout(QWEN3, batch_invariant=True).token_bytes == 2048
    # FP8 rows (1 B per element, 1024 B): ceil(1024 / 256) = 4 slot heads -> 1024 B
    assert em.kv_layout(QWEN3, batch_invariant=True, kv_cache="fp8").token_bytes == 1024
    # no head_dim: hidden / heads = 64
    cfg = {k: v for k, v in QWEN3.items() if k != "head_dim"}
    assert em.kv_layout(cfg).token_bytes == 2 * 4 * 64 * 2


def test_kv_layout_deepseek_v3_mla_by_hand():
    # MLA: one latent row of kv_lora_rank + rope = 512 + 64 = 576 elements x 2 B = 1152 B
    lay = em.kv_layout(DSV3, amx=False)
    assert (lay.kind, lay.token_bytes, lay.block_size) == ("mla", 1152, 16)  # reference MLA kernel
    assert em.kv_layout(DSV3, amx=True).block_size == 128                    # AMX_MLA
    # the invariant model: ceil(1152 / 256) = 5 slot heads of 64 x 2 B, K and V: 1280 B
    inv = em.kv_layout(DSV3, batch_invariant=True)
    assert (inv.token_bytes, inv.block_size) == (1280, 128)
    # FP8 latent: 576 B -> 3 heads -> 768 B; fp8_ds_mla: 656 B -> 3 heads -> 768 B
    assert em.kv_layout(DSV3, batch_invariant=True, kv_cache="fp8").token_bytes == 768
    assert em.kv_layout(DSV3, batch_invariant=True, kv_cache={"format": "fp8_ds_mla"}).token_bytes == 768
    with pytest.raises(InputError, match="fp8_ds_mla"):
        em.kv_layout(QWEN3, batch_invariant=True, kv_cache="fp8_ds_mla")


def test_kv_tokens_by_hand():
    # 4 prompts x (32 + 32) tokens, blocks of 128: 4 blocks for the run, but one request of
    # max_model_len 1024 needs 8; x 1.25 = 10, + the null block = 11 blocks = 1408 tokens
    assert em.kv_tokens(4, 64, 128, 1024) == 11 * 128
    # 64 prompts x 200 tokens: 2 blocks each = 128 blocks > 8; x 1.25 = 160, + 1 = 161
    assert em.kv_tokens(64, 200, 128, 1024) == 161 * 128
    # MLA blocks of 16: 4 x 4 = 16 < 64 for max_model_len; 80 + 1 = 81 blocks
    assert em.kv_tokens(4, 64, 16, 1024) == 81 * 16
    assert em.kv_tokens(4, 64, 16, 1024, safety=1.0) == 65 * 16


def test_engine_need_by_hand():
    params = 1_264_000_000
    q = em.engine_need(QWEN3, params, dtype="bfloat16", n_prompts=4, seq_len=64,
                       max_model_len=1024)
    assert q.weights == 2 * params
    assert q.kv == 2 * 2048 * 1408                       # layers x B per token x tokens
    assert q.total == 2 * params + 2 * 2048 * 1408 + em.ENGINE_OVERHEAD
    d = em.engine_need(DSV3, params, dtype="bfloat16", n_prompts=4, seq_len=64,
                       max_model_len=1024, amx=False)
    assert d.kv == 2 * 1152 * 81 * 16
    inv = em.engine_need(DSV3, params, dtype="bfloat16", n_prompts=4, seq_len=64,
                         max_model_len=1024, batch_invariant=True)
    assert inv.kv == 2 * 1280 * 1408
    assert inv.weights == int(2 * params * em.INVARIANT_WEIGHT_FACTOR)
    assert "weights 2.4 GiB" in q.describe()


def test_checkpoint_params_from_the_headers(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(3, 5, dtype=torch.bfloat16), "b": torch.zeros(7, dtype=torch.float32)},
              str(tmp_path / "model.safetensors"))
    assert em.checkpoint_params(tmp_path) == (15 + 7, 15 * 2 + 7 * 4)


def test_bad_input_names_the_field():
    with pytest.raises(InputError, match="'num_hidden_layers'"):
        em.kv_layout({**QWEN3, "num_hidden_layers": 0})
    with pytest.raises(InputError, match="'num_key_value_heads'"):
        em.kv_layout({**QWEN3, "num_key_value_heads": "4"})
    with pytest.raises(InputError, match="'qk_rope_head_dim'"):
        em.kv_layout({k: v for k, v in DSV3.items() if k != "qk_rope_head_dim"})
    with pytest.raises(InputError, match="'head_dim'"):
        em.kv_layout({**{k: v for k, v in QWEN3.items() if k != "head_dim"}, "hidden_size": 2050})
    with pytest.raises(InputError, match="'prompts'"):
        em.kv_tokens(0, 64, 128, 1024)
    with pytest.raises(InputError, match="'params'"):
        em.engine_need(QWEN3, -1, dtype="bfloat16", n_prompts=1, seq_len=1, max_model_len=8)
    with pytest.raises(InputError, match="'dtype'"):
        em.engine_need(QWEN3, 10, dtype="int3", n_prompts=1, seq_len=1, max_model_len=8)


# ---- properties -----------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 256), seq=st.integers(1, 4096), bs=st.sampled_from([16, 32, 128]),
       mml=st.integers(1, 8192), dn=st.integers(0, 64), ds=st.integers(0, 512))
def test_kv_tokens_monotone_and_enough(n, seq, bs, mml, dn, ds):
    t = em.kv_tokens(n, seq, bs, mml)
    assert t % bs == 0 and t >= n * seq + bs and t >= mml + bs
    assert em.kv_tokens(n + dn, seq, bs, mml) >= t
    assert em.kv_tokens(n, seq + ds, bs, mml) >= t


@settings(max_examples=100, deadline=None)
@given(params=st.integers(1, 10**11), n=st.integers(1, 128), seq=st.integers(1, 2048),
       cfg=st.sampled_from([QWEN3, DSV3]), inv=st.booleans(), dn=st.integers(0, 64),
       ds=st.integers(0, 512))
def test_engine_need_never_below_the_weights(params, n, seq, cfg, inv, dn, ds):
    kw = dict(dtype="bfloat16", max_model_len=max(seq, 16), batch_invariant=inv, amx=False)
    need = em.engine_need(cfg, params, n_prompts=n, seq_len=seq, **kw)
    assert need.total >= need.weights >= 2 * params and need.kv > 0
    assert em.engine_need(cfg, params, n_prompts=n + dn, seq_len=seq, **kw).total >= need.total
    assert em.engine_need(cfg, params, n_prompts=n, seq_len=seq + ds,
                          **{**kw, "max_model_len": max(seq + ds, 16)}).total >= need.total


# ---- the settings passed to vLLM --------------------------------------------------------------
def test_engine_settings_derived_when_the_default_share_does_not_hold():
    big = em.EngineNeed(weights=int(2.6 * GiB), kv=6 * 2**20)
    tiny = em.EngineNeed(weights=2 * 2**20, kv=3 * 2**20)
    total, free = 24 * GiB, 20 * GiB
    # 0.1 x 24 GiB = 2.4 GiB < the weights: vLLM's "requested memory for kv (-1.65/...)"
    assert em.engine_settings([tiny, big], {}, total=total, free=free) == {
        "kv_cache_memory_bytes": big.kv}
    assert em.engine_settings([tiny], {}, total=total, free=free) == {}     # the tiny models
    assert em.engine_settings([tiny], {}, total=total, free=2 * GiB) == {   # share not free
        "kv_cache_memory_bytes": tiny.kv}
    # a user's knob wins; on GPU nothing is derived
    for user in ({"gpu_memory_utilization": 0.5}, {"kv_cache_memory_bytes": 1 << 28}):
        assert em.engine_settings([big], user, total=total, free=free, env={}) == {}
    assert em.engine_settings([big], {}, total=total, free=free,
                              env={"VLLM_CPU_KVCACHE_SPACE": "2"}) == {}
    assert em.engine_settings([big], {}, total=total, free=free, on_gpu=True) == {}
    assert em.footprint(big, {"kv_cache_memory_bytes": big.kv}, total) == big.total
    assert em.footprint(tiny, {}, total) == int(0.1 * total) + em.ENGINE_OVERHEAD - em.WORKER_OVERHEAD


# ---- the plan, against a faked free-memory number -----------------------------------------------
def _fake_memory(monkeypatch, total, available):
    import psutil

    vm = collections.namedtuple("svmem", "total available percent used free")
    monkeypatch.setattr(psutil, "virtual_memory",
                        lambda: vm(total, available, 100 * (1 - available / total),
                                   total - available, available))


def _want(row, scenario, engine, eb, shared=True, trainer=("bfloat16", None), tb=GiB, extra=0):
    return em.Want(row, scenario, engine, eb, shared, trainer, tb, extra)


WANTS = [_want("baseline", "full", "stock", 4 * GiB),
         _want("fp32", "full", "stock", 4 * GiB, trainer=("float32", None), tb=2 * GiB),
         _want("nvfp4", "nvfp4 experts", "stock", 4 * GiB, extra=2 * GiB),
         _want("bitwise", "batch-invariant", "batch-invariant", 9 * GiB,
               trainer=("invariant", None), tb=3 * GiB),
         _want("fp8 kv", "batch-invariant, FP8 KV", "batch-invariant, FP8 KV", 9 * GiB,
               shared=False, trainer=("invariant", "fp8"), tb=3 * GiB)]


def test_plan_everything_together(monkeypatch):
    _fake_memory(monkeypatch, 64 * GiB, 40 * GiB)
    plan = em.plan_rows(WANTS)
    assert plan.together and plan.free == 40 * GiB and not plan.alone_scenarios
    assert plan.lines() == ["memory: 40.0 GiB free of 64.0 GiB; every row runs together"]
    assert not plan.release_before_scoring


def test_plan_engines_alone_when_they_do_not_fit_beside(monkeypatch):
    _fake_memory(monkeypatch, 24 * GiB, 16 * GiB)      # 15.5 GiB beside the 0.5 GiB headroom
    plan = em.plan_rows(WANTS)
    modes = {s.row: s.mode for s in plan.steps}
    # stock (4) + in place (2) fit; batch-invariant (9) beside stock (4): 13 <= 15.5, together;
    # FP8 KV (9) beside both (13): 22 > 15.5 -> alone
    assert modes == {"baseline": "together", "fp32": "together", "nvfp4": "together",
                     "bitwise": "together", "fp8 kv": "alone"}
    assert plan.alone_scenarios == {"batch-invariant, FP8 KV"}
    why = plan.step("fp8 kv").reason
    assert why.startswith("its engine (batch-invariant, FP8 KV, 9.0 GiB) starts after the other "
                          "engines are closed and the trainer copies freed") and "22.0 GiB" in why
    # the engines were closed before FP8 KV, which closes once sampled: the trainer copies
    # (1 + 2 + 3 + 3 = 9 GiB) fit in what is left
    assert not plan.release_before_scoring and not plan.trainer_one_at_a_time
    text = "\n".join(plan.lines())
    assert "fp8 kv: alone: its engine" in text and "baseline" not in text


def test_plan_skips_what_does_not_fit_alone_and_loads_copies_one_at_a_time(monkeypatch):
    _fake_memory(monkeypatch, 16 * GiB, 8 * GiB)       # 7.5 GiB beside the headroom
    plan = em.plan_rows(WANTS)
    s = {x.row: x for x in plan.steps}
    assert s["bitwise"].mode == s["fp8 kv"].mode == "skipped"
    assert s["bitwise"].reason == ("memory: its engine (batch-invariant, 9.0 GiB) needs more than "
                                   "the 7.5 GiB free beside 0.5 GiB headroom")
    assert plan.skipped() == {"bitwise": s["bitwise"].reason, "fp8 kv": s["fp8 kv"].reason}
    # stock 4 + 2 in place = 6 <= 7.5: runs; its copies (1 + 2 GiB) fit beside the engine (4)
    assert s["baseline"].mode == "together" and not plan.release_before_scoring
    assert plan.prefetch_bytes == 4 * GiB           # the largest engine that runs
    _fake_memory(monkeypatch, 16 * GiB, 6 * GiB)       # 5.5 GiB: in place (4 + 2) does not fit
    plan = em.plan_rows(WANTS)
    assert plan.step("nvfp4").mode == "skipped" and "served in place" in plan.step("nvfp4").reason
    assert plan.step("baseline").mode == "together"
    # two copies of 3 GiB do not fit together in 5.5 GiB, but the doctor scores one copy at a
    # time (each freed after its last row): each fits beside the 2 GiB engine; 6 GiB does not
    wants = [_want("a", "full", "stock", 2 * GiB, trainer=("x", None), tb=3 * GiB),
             _want("b", "full", "stock", 2 * GiB, trainer=("y", None), tb=3 * GiB),
             _want("c", "full", "stock", 2 * GiB, trainer=("z", None), tb=6 * GiB)]
    plan = em.plan_rows(wants)
    assert plan.trainer_one_at_a_time and not plan.release_before_scoring
    assert plan.step("a").mode == plan.step("b").mode == "together"
    assert plan.step("c").mode == "skipped" and plan.step("c").reason == (
        "memory: its trainer copy (HF z, 6.0 GiB with scoring) needs more than 5.5 GiB free")
    assert "  trainer copies: scored one at a time, each freed after its last row (6.0 GiB " \
        "together): HF x 3.0 GiB, HF y 3.0 GiB" in plan.lines()
    # 4.5 GiB: the largest copy that runs (3) does not fit beside the engine (2): closed first
    _fake_memory(monkeypatch, 16 * GiB, 5 * GiB)
    plan = em.plan_rows(wants[:2])
    assert plan.release_before_scoring and plan.lines()[-1].startswith(
        "  engines closed before scoring: the largest trainer copy (3.0 GiB with scoring)")


def test_make_room_frees_oldest_copies_until_the_need_fits():
    models = {"a": 1, "b": 2, "c": 3}
    avail = iter([1 * GiB, 2 * GiB, 5 * GiB])
    assert em.make_room(models, 3 * GiB, keep=("a",), available=lambda: next(avail)) == ["b", "c"]
    assert models == {"a": 1}


# ---- the doctor with stand-in engines and a faked free-memory number -------------------------
class StandIn:
    log: list = []
    made: list = []

    def __init__(self, model_dir, **kw):
        from skyrl_numerics.engine.generator import EngineInfo

        self.kw, self.llm = kw, object()
        self.name = "invariant" if kw.get("batch_invariant") else "stock"
        self.name += f" {kw['kv_cache']}" if kw.get("kv_cache") else ""
        self.vocab_size, self.info = 512, EngineInfo("fake", "0")
        StandIn.log.append(("start", self.name))
        StandIn.made.append(self)

    def generate(self, prompts, *, max_tokens, seed=0, **kw):
        from skyrl_numerics.rollout import Rollout

        rng = np.random.default_rng(seed)
        resp = [rng.integers(2, 512, size=max_tokens).tolist() for _ in prompts]
        return Rollout.from_lists(prompts, resp, [[-6.2] * max_tokens for _ in prompts],
                                  sampling={}, engine="fake", engine_version="0",
                                  meta={"tokens_per_s": 1.0})

    def close(self):
        if self.llm is not None:
            StandIn.log.append(("close", self.name))
        self.llm = None


ROWS = ["baseline: HF trainer, bf16", "+ batch-invariant (trainer and vLLM)",
        "FP8 KV engine: trainer without KV simulation"]


def _doctor(monkeypatch, fake_engines, model_dir, total, available):
    from skyrl_numerics import doctor

    pytest.importorskip("vllm")      # inspect_checkpoint reads vLLM's model registry
    StandIn.log, StandIn.made = [], []
    fake_engines(StandIn)
    _fake_memory(monkeypatch, total, available)
    monkeypatch.setenv("SKYRL_NUMERICS_DOCTOR_PREFETCH", "0")
    return doctor.run_doctor(rows=ROWS, n_prompts=2, prompt_len=4, max_tokens=3, progress=False,
                             model_dir=model_dir)


def test_doctor_runs_engines_alone_when_memory_is_short(monkeypatch, fake_engines, qwen_moe_dir,
                                                        capsys):
    # 4 GiB of RAM: vLLM's 0.1 share cannot hold an engine, so the setting is derived; 2.4 GiB
    # beside the headroom hold one tiny engine (1.25 GiB overhead + its KV), not two
    res = _doctor(monkeypatch, fake_engines, qwen_moe_dir, 4 * GiB, int(2.9 * GiB))
    mem = res.settings["memory"]
    kv = mem["settings"]["kv_cache_memory_bytes"]
    assert kv > 0 and res.settings["engine_args"] == {}            # what the user gave: nothing
    assert {m["mode"] for m in mem["rows"].values()} == {"together", "alone"}
    assert mem["rows"][ROWS[1]]["mode"] == mem["rows"][ROWS[2]]["mode"] == "alone"
    # each engine starts after the previous one closed, with the derived KV size
    assert StandIn.log == [("start", "stock"), ("close", "stock"), ("start", "invariant"),
                           ("close", "invariant"), ("start", "invariant fp8"),
                           ("close", "invariant fp8")]
    assert all(r.extra["status"] == "measured" for r in res.rows)
    assert all(e.kw["kv_cache_memory_bytes"] == kv for e in StandIn.made)
    printed = capsys.readouterr().out
    assert "memory: 2.9 GiB free of 4.0 GiB; engines get kv_cache_memory_bytes=" in printed
    assert f"  {ROWS[1]}: alone: its engine (batch-invariant" in printed


def test_doctor_skips_rows_whose_engine_does_not_fit(monkeypatch, fake_engines, qwen_moe_dir):
    res = _doctor(monkeypatch, fake_engines, qwen_moe_dir, 4 * GiB, int(1.5 * GiB))
    status = {r.name: r.extra["status"] for r in res.rows}
    assert all(s.startswith("skipped: memory: its engine (") for s in status.values()), status
    assert StandIn.log == []


def test_doctor_keeps_everything_together_with_room(monkeypatch, fake_engines, qwen_moe_dir):
    res = _doctor(monkeypatch, fake_engines, qwen_moe_dir, 64 * GiB, 40 * GiB)
    assert res.settings["memory"]["settings"] == {}                # the default share holds
    assert all(e.kw.get("kv_cache_memory_bytes") is None for e in StandIn.made)
    assert StandIn.log == [("start", "stock"), ("start", "invariant"), ("start", "invariant fp8"),
                           ("close", "invariant fp8")]


def test_doctor_sizes_engines_when_the_default_shares_do_not_fit(monkeypatch, fake_engines,
                                                                 qwen_moe_dir):
    # 24 GiB: the 0.1 share (2.4 GiB) holds one tiny engine, but 3 engines at 2.4 + 0.5 GiB do
    # not fit in 5 GiB: sized by what they need (1.25 GiB + KV each) they all run together
    res = _doctor(monkeypatch, fake_engines, qwen_moe_dir, 24 * GiB, 5 * GiB)
    mem = res.settings["memory"]
    assert mem["settings"]["kv_cache_memory_bytes"] > 0
    assert {m["mode"] for m in mem["rows"].values()} == {"together"}
