"""`skyrl-numerics train`: real vLLM generator, FSDP2 trainer (one process), delta sync into the
running engine, with and without Ray actors."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from skyrl_numerics.cli import main
from skyrl_numerics.errors import InputError
from skyrl_numerics.invariant.base import InvariantCausalLM
from skyrl_numerics.trainer import loop_actors
from skyrl_numerics.trainer.loop import CONFIGS, ConfigRun, LoopRun, LoopSettings, run_loop

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _run(tmp_path, *extra):
    out = tmp_path / "train"
    assert main(["train", "--steps", "3", "--prompts", "2", "--samples", "4", "--max-tokens", "8",
                 "--out", str(out), "--no-progress", *extra]) == 0
    return json.loads((out / "train.json").read_text()), out


def test_train_plain_vs_aligned_vs_bitwise(tmp_path, vllm_qwen, vllm_qwen_invariant):
    probe = [[5, 6, 7, 8, 9]]
    before = vllm_qwen.generate(probe, max_tokens=8, seed=3)
    before_inv = vllm_qwen_invariant.generate(probe, max_tokens=8, seed=3)
    res, out = _run(tmp_path)
    # the shared engine got the checkpoint's weights back: same sampled tokens, same bits
    after = vllm_qwen.generate(probe, max_tokens=8, seed=3)
    assert after.response_tokens.tolist() == before.response_tokens.tolist()
    assert after.rollout_logprobs.tolist() == before.rollout_logprobs.tolist()
    plain, aligned = res["history"]["plain"], res["history"]["aligned"]
    assert len(plain) == len(aligned) == 3
    # top-p/top-k sampling: the plain trainer normalizes over the full vocabulary (gap ~ log of
    # the kept mass); support replay + R3 bring it down to kernel noise
    for p, a in zip(plain, aligned):
        assert a["gap_mean_abs"] < 0.1 * p["gap_mean_abs"], (p, a)
    # every step published a delta smaller than the bf16 weights and the engine took it
    for r in plain + aligned:
        assert 0 < r["sync_payload_bytes"] < r["sync_raw_bytes"]
        assert r["sync_version"] >= 1
    assert any(k.startswith("correction/") for k in aligned[0])
    assert (out / "train.png").read_bytes()[:4] == b"\x89PNG"
    # bitwise: true on-policy. The invariant engine took every update in place (otherwise steps
    # 1, 2 would show a gap) and the trainer's gradient is the exact on-policy gradient.
    bitwise = res["history"]["bitwise"]
    assert len(bitwise) == 3
    for r in bitwise:
        assert r["gap_mean_abs"] == 0.0 and r["gap_max_abs"] == 0.0, r
        assert r["gap_frac_bitwise_equal"] == 1.0, r
        assert r["grad_relerr_onpolicy"] == 0.0 and r["grad_cos_onpolicy"] == pytest.approx(1, abs=1e-12)
        assert 0 < r["sync_payload_bytes"] < r["sync_raw_bytes"]
    # the plain trainer's gradient is biased by the top-p/top-k mismatch, aligned's far less
    # (measured: cos 0.80-0.95 plain, >= 0.998 aligned)
    for p, a in zip(plain, aligned):
        assert p["grad_cos_onpolicy"] < 0.99 < a["grad_cos_onpolicy"] <= 1.0, (p, a)
        assert a["grad_relerr_onpolicy"] < 0.5 * p["grad_relerr_onpolicy"], (p, a)
    after_inv = vllm_qwen_invariant.generate(probe, max_tokens=8, seed=3)
    assert after_inv.rollout_logprobs.tolist() == before_inv.rollout_logprobs.tolist()


@pytest.mark.ray
def test_train_with_ray_actors(tmp_path):
    res, _ = _run(tmp_path, "--ray", "--configs", "aligned", "--no-grad")
    rows = res["history"]["aligned"]
    assert len(rows) == 3 and res["settings"]["use_ray"]
    # the actors really ran the loop: the engine followed the trainer (small gap every step)
    # and the deltas crossed the store
    for r in rows:
        assert r["gap_mean_abs"] < 0.05 and 0 < r["sync_payload_bytes"] < r["sync_raw_bytes"], r


def test_train_async_one_step_off_policy(tmp_path, vllm_qwen):
    """--async: rollout s+1 is sampled before update s lands. The lag shows up as gap (measured:
    3e-3 at step 0, 0.28-0.41 after, lr 1e-2) and the token TIS starts clipping."""
    res, _ = _run(tmp_path, "--async", "--configs", "aligned", "--no-grad")
    rows = res["history"]["aligned"]
    assert [r["rollout_lag"] for r in rows] == [0, 1, 1]
    # train.json records the trainer's host and the engine worker's own report
    assert res["host"]["torch_cpu_capability"] == res["engine_host"]["torch_cpu_capability"]
    assert res["engine_host"]["vllm_build_loaded"] and res["isa_mismatch"] is False
    assert rows[0]["gap_mean_abs"] < 0.02
    for r in rows[1:]:
        assert r["gap_mean_abs"] > 10 * rows[0]["gap_mean_abs"], rows
    # the lag is large enough that token TIS clips (measured 1.6-4.3 % of tokens per lagged step)
    clipped = [r["correction/frac_tokens_clipped"] for r in rows]
    assert clipped[0] == 0.0 and max(clipped[1:]) > 0.0, clipped


def test_train_multi_turn(tmp_path, vllm_qwen, vllm_qwen_invariant):
    """--multi-turn 3: tool-using trajectories (toy key-value tool), observation tokens masked out
    of loss and gap, routes as turn deltas. bitwise: Δ = 0 on every model token of every turn,
    every step, after real updates; aligned (R3 + support + TIS across turns): a small gap."""
    res, out = _run(tmp_path, "--multi-turn", "3", "--configs", "aligned,bitwise",
                    "--max-tokens", "5")
    assert res["settings"]["turns"] == 3 and res["settings"]["task"]["reward"] == "env"
    for name in ("aligned", "bitwise"):
        rows = res["history"][name]
        assert len(rows) == 3
        for r in rows:
            assert r["model_tokens"] > 0 and r["observation_tokens"] > 0, r
            assert len(r["gap_per_turn_max_abs"]) >= 2, r
            assert 0 < r["route_bytes_delta"] < r["route_bytes_full"], r
    for r in res["history"]["bitwise"]:
        assert r["gap_max_abs"] == 0.0 and r["gap_frac_bitwise_equal"] == 1.0, r
        assert set(r["gap_per_turn_max_abs"]) == {0.0}, r
        assert r["grad_relerr_onpolicy"] == 0.0, r
        assert 0 < r["sync_payload_bytes"] < r["sync_raw_bytes"]   # real updates reached the engine
    for r in res["history"]["aligned"]:
        assert r["gap_mean_abs"] < 0.05 and r["grad_cos_onpolicy"] > 0.99, r
    assert (out / "train.png").read_bytes()[:4] == b"\x89PNG"


# ---- bitwise: the engine's logprobs are the old logprobs, the recompute sampled and checked ------
def _bitwise_run(model_dir, tmp_path, every: int, steps: int):
    cfg = dataclasses.replace(CONFIGS["bitwise"], recompute_old_every=every)
    settings = LoopSettings(steps=steps, prompts_per_step=2, samples_per_prompt=4, max_tokens=8,
                            measure_grad=False)
    return run_loop(LoopRun(str(model_dir), [cfg], settings, work_dir=tmp_path / "w", progress=False))


def test_bitwise_skips_the_old_logprob_forward_between_checked_steps(qwen_moe_dir, vllm_qwen_invariant,
                                                                     monkeypatch, tmp_path):
    """recompute_old_every=2 over 3 steps: steps 0 and 2 recompute (and pass the bitwise check),
    step 1 does not — the trainer runs one invariant forward fewer there (counted: calls of the
    invariant model's packed forward, the one every trainer-side logprob goes through)."""
    forwards, per_step = [0], []
    packed = InvariantCausalLM.packed_hidden

    def counted(self, seqs):
        forwards[0] += 1
        return packed(self, seqs)

    one_step = ConfigRun.one_step

    def step_counted(self, step, ro_ref):
        before = forwards[0]
        row = one_step(self, step, ro_ref)
        per_step.append(forwards[0] - before)
        return row

    monkeypatch.setattr(InvariantCausalLM, "packed_hidden", counted)
    monkeypatch.setattr(ConfigRun, "one_step", step_counted)
    rows = _bitwise_run(qwen_moe_dir, tmp_path, every=2, steps=3).history["bitwise"]
    assert [r["old_logprobs_recomputed"] for r in rows] == [True, False, True]
    assert per_step[0] == per_step[2] == 2 * per_step[1] > 0, per_step     # recompute + update vs update
    for r in rows:   # checked bitwise on 0 and 2; step 1's gap is the update forward's, also 0
        assert r["gap_max_abs"] == 0.0 and r["gap_frac_bitwise_equal"] == 1.0, r
        assert r["time_old_logprobs_s"] >= 0 and r["time_train_s"] > 0 and 0 < r["sync_payload_bytes"]
    assert rows[1]["time_old_logprobs_s"] < 0.1 * rows[0]["time_old_logprobs_s"], rows


def test_bitwise_check_names_a_one_ulp_engine_difference(qwen_moe_dir, vllm_qwen_invariant, monkeypatch,
                                                         tmp_path):
    """One engine logprob moved by one ulp at step 1 (checked every step): the loop stops with the
    project's error naming step 1, the sequence and the token, before that step's update."""
    planted = {}

    class OneUlpOff(loop_actors.GeneratorWorker):
        calls = 0

        def generate(self, prompts, **sampling):
            ro = super().generate(prompts, **sampling)
            if OneUlpOff.calls == 1:
                seq = 5
                tok = min(2, int(ro.response_lens[seq]) - 1)
                at = int(ro.response_cu[seq]) + tok
                ro.rollout_logprobs[at] = np.nextafter(ro.rollout_logprobs[at], np.float32(0))
                planted.update(seq=seq, tok=tok)
            OneUlpOff.calls += 1
            return ro

    monkeypatch.setattr(loop_actors, "GeneratorWorker", OneUlpOff)
    with pytest.raises(InputError) as e:
        _bitwise_run(qwen_moe_dir, tmp_path, every=1, steps=2)
    assert (e.value.row, e.value.index, e.value.field) == (planted["seq"], planted["tok"], "rollout_logprobs")
    assert f"step 1: bitwise config, the recomputed trainer logprob of sequence {planted['seq']} " \
           f"token {planted['tok']}" in str(e.value)
