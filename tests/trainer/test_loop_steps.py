"""``run_loop`` as a composition of named steps, driven with stand-in workers (no engine, no
trainer): the order of generate / logprobs / step / publish / sync per step, the one-step lag of
``off_policy``, the history row's keys (``train.json``'s schema) and the settings record."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from skyrl_numerics.errors import ContractMismatch, InputError
from skyrl_numerics.invariant import contract as C
from skyrl_numerics.rollout import Rollout
from skyrl_numerics.trainer import loop_actors
from skyrl_numerics.trainer.loop import CONFIGS, LoopPlacement, LoopRun, LoopSettings, run_loop

CALLS: list = []
# the execution contract both stand-ins report (a real one, of the stand-in config)
CONTRACT = C.of_hf({"architectures": ["Qwen3MoeForCausalLM"]}, dtype="bfloat16").to_dict()
ENGINE_CONTRACTS: dict = {}    # sync version -> the contract the engine reports at that sync


class FakeGenerator:
    def __init__(self, model_dir, batch_invariant=False, kv_cache=None, **kw):
        self.version = 0

    def attach(self, sync_dir, *sharded):
        CALLS.append(("attach",))
        return {"version": 0}

    def generate(self, prompts, *, seed, n, **sampling):
        CALLS.append(("generate", seed, self.version))
        rows = [p for p in prompts for _ in range(n)]
        resp = [[3 + (seed + i) % 90, 70, 5] for i in range(len(rows))]
        return Rollout.from_lists(rows, resp, [[-1.0, -2.0, -0.5]] * len(rows),
                                  group_ids=np.repeat(np.arange(len(prompts)), n), sampling=dict(sampling))

    def sync(self, *sharded):
        self.version += 1
        CALLS.append(("sync", self.version))
        return {"version": self.version, "engine_update_s": 0.01}

    def restore(self):
        CALLS.append(("restore",))

    def engine_host(self):
        return {"isa": "test"}

    def contract(self):
        CALLS.append(("contract", self.version))
        got = ENGINE_CONTRACTS.get(self.version + 1, CONTRACT)
        if isinstance(got, Exception):    # an engine that cannot report (a server without the route)
            raise got
        return got


class FakeTrainer:
    def __init__(self, model_dir, config, sync_dir, snapshot_every, backend="fsdp"):
        self.config = config
        self.v = 0

    def host_info(self):
        return {"isa": "test"}

    def contract(self):
        return CONTRACT

    def sharded_info(self):
        return None

    def logprobs(self, rollout):
        CALLS.append(("logprobs",))
        # bitwise: the engine's numbers bit for bit, as the invariant trainer computes them
        return rollout.rollout_logprobs.copy() if self.config.bitwise else rollout.rollout_logprobs - 0.01

    def last_logprobs(self):
        CALLS.append(("last_logprobs",))
        return self.last_rollout.rollout_logprobs.copy()

    def step(self, rollout, rewards, old):
        CALLS.append(("step",))
        self.last_rollout, self.last_old = rollout, old
        return {"loss": 0.5, "clipfrac": 0.0, "entropy": 1.0, "correction/mean_weight": 1.0}

    def publish(self, full=False):
        self.v += 1
        CALLS.append(("publish", self.v))
        return {"version": self.v, "payload_bytes": 10, "raw_bytes": 100}

    def close(self):
        CALLS.append(("close",))


@pytest.fixture
def fakes(monkeypatch, tmp_path):
    monkeypatch.setattr(loop_actors, "GeneratorWorker", FakeGenerator)
    monkeypatch.setattr(loop_actors, "TrainerWorker", FakeTrainer)
    CALLS.clear()
    ENGINE_CONTRACTS.clear()
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3MoeForCausalLM"]}))
    return tmp_path


ROW_KEYS = ["step", "reward", "rollout_lag", "gap_mean_abs", "gap_max_abs", "gap_frac_bitwise_equal", "gap_F2",
            "gap_kl_k3", "loss", "clipfrac", "entropy", "correction/mean_weight", "sync_version",
            "sync_payload_bytes", "sync_raw_bytes", "engine_update_s", "time_generate_s", "time_old_logprobs_s",
            "time_train_s", "time_sync_s", "tis_clip_frac", "old_logprobs_recomputed"]


def _settings(**kw):
    return LoopSettings(**{"steps": 3, "prompts_per_step": 2, "samples_per_prompt": 2, "measure_grad": False, **kw})


def test_one_step_is_generate_logprobs_train_publish_sync(fakes):
    res = run_loop(LoopRun(str(fakes), [CONFIGS["aligned"]], _settings(), work_dir=fakes / "w", progress=False))
    rows = res.history["aligned"]
    assert [list(r) for r in rows] == [ROW_KEYS] * 3            # train.json's history schema
    assert [r["rollout_lag"] for r in rows] == [0, 0, 0] and [r["sync_version"] for r in rows] == [1, 2, 3]
    kinds = [c[0] for c in CALLS]
    # the engine's contract before it takes the configuration's weights and before every sync
    assert kinds == (["contract", "attach"] + ["generate", "logprobs", "step", "publish", "contract", "sync"] * 3
                     + ["close", "restore"])
    # on-policy: step s samples with the weights of version s (after s syncs)
    assert [c[2] for c in CALLS if c[0] == "generate"] == [0, 1, 2]
    s = res.settings
    assert s["steps"] == 3 and s["backend"] == "fsdp" and s["task"] == {"limit": 64}
    assert s["configs"][0]["name"] == "aligned" and s["configs"][0]["trainer"]["correction"] == "token_tis"
    json.dumps(res.to_dict())


def test_contracts_are_recorded_and_a_bitwise_config_refuses_a_changed_engine(fakes):
    """Equal contracts: recorded with the number of checks. An engine whose contract changes at
    sync 2 (its KV format) is recorded for ``plain`` and refused for ``bitwise`` before it
    takes version 2, naming the field."""
    other = C.ExecutionContract.from_dict(CONTRACT)
    other = dataclasses.replace(other, kv_format='{"format":"fp8","k_scale":1.0,"v_scale":1.0}')
    res = run_loop(str(fakes), [CONFIGS["plain"]], _settings(), work_dir=fakes / "a", progress=False)
    rec = res.to_dict()["contracts"]["plain"]
    assert rec["equal"] and rec["checks"] == 4 and not rec["refuses"]
    assert rec["trainer"]["fingerprint"] == rec["engine"]["fingerprint"] == CONTRACT["fingerprint"]
    ENGINE_CONTRACTS[2] = ENGINE_CONTRACTS[3] = other.to_dict()
    res = run_loop(str(fakes), [CONFIGS["plain"]], _settings(), work_dir=fakes / "b", progress=False)
    rec = res.contracts["plain"]
    assert [d["field"] for d in rec["diff"]] == ["kv_format"] and rec["engine_changed_at"] == ["at sync 2"]
    assert rec["differed_at"] == {"at sync 2": ["kv_format"], "at sync 3": ["kv_format"]}
    assert not rec["equal"] and rec["checks"] == 4
    CALLS.clear()
    with pytest.raises(ContractMismatch, match="config 'bitwise', at sync 2\\): trainer vs engine differ "
                                               "in kv_format ") as e:
        run_loop(str(fakes), [CONFIGS["bitwise"]], _settings(), work_dir=fakes / "c", progress=False)
    assert e.value.fields == ["kv_format"]
    assert ("sync", 1) in CALLS and ("sync", 2) not in CALLS     # version 2 never applied


def test_an_engine_without_a_contract_is_recorded_or_refused(fakes):
    ENGINE_CONTRACTS[1] = InputError("http://x/skyrl_contract: HTTP 404", field="contract")
    res = run_loop(str(fakes), [CONFIGS["plain"]], _settings(), work_dir=fakes / "a", progress=False)
    rec = res.contracts["plain"]
    # (the stand-in answers version 0's request before the first step and at sync 1)
    assert list(rec["unavailable_at"]) == ["before the first step", "at sync 1"] and rec["checks"] == 2
    with pytest.raises(InputError, match="field 'contract': config 'bitwise', before the first step: "
                                         "the engine reported no execution contract") as e:
        run_loop(str(fakes), [CONFIGS["bitwise"]], _settings(), work_dir=fakes / "b", progress=False)
    assert not isinstance(e.value, ContractMismatch)


def test_off_policy_samples_the_next_rollout_before_the_sync(fakes):
    res = run_loop(str(fakes), [CONFIGS["plain"]], _settings(off_policy=1), work_dir=fakes / "w",
                   progress=False)
    assert [r["rollout_lag"] for r in res.history["plain"]] == [0, 1, 1]
    # step s+1 is queued before step s's sync: it samples with the weights before that sync
    assert [c[2] for c in CALLS if c[0] == "generate"] == [0, 0, 1]
    assert "tis_clip_frac" not in res.history["plain"][0]


def test_the_old_keyword_spelling_builds_the_same_run(fakes):
    a = run_loop(str(fakes), [CONFIGS["plain"]], _settings(), work_dir=fakes / "a", progress=False,
                 backend="fsdp", replicas=1)
    b = run_loop(LoopRun(str(fakes), [CONFIGS["plain"]], _settings(), LoopPlacement(backend="fsdp"),
                         work_dir=fakes / "b", progress=False))
    strip = lambda h: [{k: v for k, v in r.items() if not k.startswith("time_")} for r in h]  # noqa: E731
    assert strip(a.history["plain"]) == strip(b.history["plain"]) and a.settings == b.settings


def test_bitwise_uses_the_engines_logprobs_and_recomputes_every_k_steps(fakes):
    """bitwise: no trainer recompute except at steps 0, K, 2K (the old logprobs given to the
    update are the engine's every step); the gap comes from the update's forward when skipped."""
    cfg = dataclasses.replace(CONFIGS["bitwise"], recompute_old_every=2)
    res = run_loop(LoopRun(str(fakes), [cfg], _settings(steps=5), work_dir=fakes / "w", progress=False))
    rows = res.history["bitwise"]
    assert [r["old_logprobs_recomputed"] for r in rows] == [True, False, True, False, True]
    per_step = " ".join(c[0] for c in CALLS if c[0] in ("generate", "logprobs", "step", "last_logprobs"))
    assert per_step.split("generate ")[1:] == ["logprobs step ", "step last_logprobs "] * 2 + ["logprobs step"]
    assert all(r["gap_max_abs"] == 0.0 and r["time_old_logprobs_s"] >= 0.0 for r in rows)
    assert res.settings["configs"][0]["recompute_old_every"] == 2
    # the other configurations recompute every step (test_one_step_... above: aligned)


@pytest.mark.parametrize("every", [0, -3, 1.5])
def test_recompute_period_must_be_a_positive_integer(every):
    with pytest.raises(InputError) as e:
        dataclasses.replace(CONFIGS["bitwise"], recompute_old_every=every)
    assert e.value.field == "recompute_old_every"


@pytest.mark.parametrize("kw, field", [
    (dict(tp=2), "tp"), (dict(backend="jax"), "backend"), (dict(dp=0), "dp"),
    (dict(replicas=2, server="http://x"), "replicas"), (dict(dp=2, server="http://x"), "server"),
])
def test_placements_that_cannot_run_are_refused_before_anything_starts(fakes, kw, field):
    with pytest.raises(InputError) as e:
        run_loop(str(fakes), [CONFIGS["plain"]], _settings(), progress=False, **kw)
    assert e.value.field == field and CALLS == []


def test_train_cli_refuses_a_recompute_period_below_one_before_any_engine(tmp_path, capsys):
    from skyrl_numerics.cli import main

    assert main(["train", "--recompute-old-every", "0", "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "field 'recompute_old_every'" in err and len(err.splitlines()) == 1, err


def test_aligned_on_a_dense_checkpoint_drops_only_router_replay(tmp_path):
    """A dense checkpoint has no routers: ``aligned`` runs as support replay + TIS (route_replay
    off, everything else as configured), so its trainer does not refuse a rollout without
    routes; an MoE checkpoint keeps every configuration as given."""
    from skyrl_numerics.models import tiny_config
    from skyrl_numerics.trainer.loop import without_r3_on_dense

    cfgs = [CONFIGS["plain"], CONFIGS["aligned"], CONFIGS["bitwise"]]
    for family, moe in (("qwen3", False), ("qwen3_moe", True)):
        d = tmp_path / family
        d.mkdir()
        (d / "config.json").write_text(json.dumps(tiny_config(family)))
        got = without_r3_on_dense(LoopRun(str(d), cfgs))
        assert got[1].trainer.route_replay is moe
        assert got[1].trainer.use_support and got[1].trainer.correction == CONFIGS["aligned"].trainer.correction
        assert dataclasses.replace(got[1], trainer=CONFIGS["aligned"].trainer) == CONFIGS["aligned"]
        assert got[0] == cfgs[0] and got[2] == cfgs[2]
