"""The doctor's trainer copies: their counted bytes equal the real modules' tensors (each dtype,
the invariant model, QAT), the rows are scored one copy at a time with each copy freed after its
last row, no copy is held when an engine starts, and the CLI's up-front check names the rows
that run alone or are skipped (tiny Qwen3-MoE; the engines are stand-ins)."""
from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from skyrl_numerics.doctor import trainer_memory as tm


@pytest.fixture(autouse=True)
def _default_engine_share(monkeypatch):
    """These tests model the engines' default share of RAM (0.1): without the suite's smaller one
    (tests/conftest.py)."""
    monkeypatch.delenv("SKYRL_NUMERICS_CPU_MEMORY_SHARE", raising=False)

GiB = 1 << 30


def _nbytes(module) -> dict:
    out, seen = {}, set()
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        d = str(t.dtype).replace("torch.", "")
        out[d] = out.get(d, 0) + t.nbytes
    return out


@pytest.fixture
def info(qwen_moe_dir):
    from skyrl_numerics.doctor.model_check import inspect_checkpoint

    return inspect_checkpoint(qwen_moe_dir)


@pytest.mark.parametrize("key", [(None, None), ("float32", None), ("bfloat16", None),
                                 (None, "nvfp4"), ("invariant", None), ("invariant", "fp8")])
def test_counted_bytes_are_the_loaded_copys_tensors(info, key):
    from skyrl_numerics.doctor.rows import DoctorContext

    ctx = DoctorContext(model_dir=info.path, family=info.model_type, info=info)
    if key[0] == "invariant":
        from skyrl_numerics.invariant import from_checkpoint

        model = from_checkpoint(info.path, kv_cache=key[1])
    else:
        model = ctx.hf_model(*key)
    real = _nbytes(model)
    assert tm.trainer_copy_bytes(info, key) == real
    if key == ("float32", None):
        assert set(real) == {"float32"} and sum(real.values()) > 4 * info.params - 1
    if key[1] == "nvfp4":   # QAT keeps the original weights: the bf16 copy's bytes, no more
        assert real == tm.trainer_copy_bytes(info, (None, None))


def test_need_adds_the_larger_transient(info):
    seq = dict(n_prompts=8, seq_len=80)
    held = sum(tm.trainer_copy_bytes(info, (None, None)).values())
    work = tm.scoring_bytes(info, (None, None), **seq)
    assert work == tm.LOGIT_COPIES * 640 * info.vocab_size * 4
    assert tm.copy_need(info, (None, None), **seq) == held + work
    # fp32 from a bf16 checkpoint: the stored bytes are mapped beside it while it converts
    from skyrl_numerics.doctor.engine_memory import checkpoint_params

    assert tm.load_bytes(info, ("float32", None)) == int(
        tm.LOAD_CONVERT * checkpoint_params(info.path)[1])
    # QAT: each forward materializes the fake-quantized stacked expert weights
    assert tm.scoring_bytes(info, (None, "nvfp4"), **seq) > work
    with pytest.raises(ValueError, match="n_prompts must be an integer"):
        tm.scoring_bytes(info, (None, None), n_prompts=0, seq_len=4)


ROW_NAMES = ["baseline: HF trainer, bf16", "HF trainer, fp32 weights",
             "+ batch-invariant (trainer and vLLM)", "nvfp4 experts: + fake-quant matched",
             "top-p/top-k: HF trainer, full-vocab", "FP8 KV engine: trainer without KV simulation"]


def _fake_rollout(n=2, p=3, r=4, seed=0):
    from skyrl_numerics.rollout import Rollout

    rng = np.random.default_rng(seed)
    return Rollout.from_lists([rng.integers(2, 200, p).tolist() for _ in range(n)],
                              [rng.integers(2, 200, r).tolist() for _ in range(n)],
                              [[-5.0] * r for _ in range(n)], sampling={"temperature": 1.0},
                              engine="none", engine_version="0")


def test_rows_scored_copy_by_copy_each_freed_after_its_last_row(info):
    from skyrl_numerics.doctor import ROWS, DoctorContext, Row, score_rows

    ctx = DoctorContext(model_dir=info.path, family=info.model_type, info=info)
    by_name = {r.name: r for r in ROWS}
    seen = []   # (row, copies held while it computed)

    def watched(row):
        def compute(c, ro):
            out = row.compute(c, ro)
            seen.append((row.name, [k for k in c._models if k[0] != "mla steps"]))
            return out
        compute.trainer = row.compute.trainer
        compute.distribution = getattr(row.compute, "distribution", None)
        return compute

    rows = [Row(n, by_name[n].scenario, watched(by_name[n])) for n in ROW_NAMES]
    rollouts = {r.scenario: _fake_rollout() for r in rows}
    out, scored = score_rows(rows, ctx, rollouts, {n: None for n in ROW_NAMES}, {})
    assert [r.name for r in out] == ROW_NAMES                      # table order kept
    assert all(r.extra["status"] == "measured" for r in out)
    # the two bf16 rows together, then the others; one copy held at a time, none at the end
    assert [n for n, _ in seen] == [ROW_NAMES[0], ROW_NAMES[4], ROW_NAMES[1], ROW_NAMES[2],
                                    ROW_NAMES[5], ROW_NAMES[3]]
    assert all(len(held) == 1 for _, held in seen), seen
    assert ctx._models == {}
    assert scored["full"].meta["trainer"] == ROW_NAMES[0]           # the scenario's first row
    order, frees = tm.scoring_order(rows)
    assert order == [0, 4, 1, 2, 5, 3]
    assert frees == {4: (None, None), 1: ("float32", None), 5: ("invariant", None),
                     3: (None, "nvfp4")}


def test_no_trainer_copy_is_held_when_an_engine_starts(monkeypatch, fake_engines, qwen_moe_dir):
    """skip_reason loads the HF copy (R3 looks for the routers) before any engine starts: the
    plan frees it, so every engine, alone or not, starts with no trainer copy in memory."""
    pytest.importorskip("vllm")
    from skyrl_numerics import doctor, models
    from test_engine_memory import StandIn, _fake_memory

    alive = []
    real_load = models.load_hf_model

    def load(*a, **kw):
        m = real_load(*a, **kw)
        alive.append(weakref.ref(m))
        return m

    monkeypatch.setattr(models, "load_hf_model", load)
    held_at_start = []

    class Watch(StandIn):
        def __init__(self, model_dir, **kw):
            gc.collect()
            held_at_start.append(sum(r() is not None for r in alive))
            super().__init__(model_dir, **kw)

    StandIn.log, StandIn.made = [], []
    fake_engines(Watch)
    monkeypatch.setenv("SKYRL_NUMERICS_DOCTOR_PREFETCH", "0")
    _fake_memory(monkeypatch, 4 * GiB, int(2.9 * GiB))   # each engine runs alone
    res = doctor.run_doctor(rows=["+ R3 (router replay)", "+ batch-invariant (trainer and vLLM)"],
                            n_prompts=2, prompt_len=4, max_tokens=3, progress=False,
                            model_dir=qwen_moe_dir)
    assert alive, "the R3 row's skip check loaded the HF copy"
    assert held_at_start == [0, 0], held_at_start
    assert res.settings["memory"]["rows"]["+ batch-invariant (trainer and vLLM)"]["mode"] == "alone"


def test_cli_check_names_the_rows_alone_or_skipped(monkeypatch, capsys, qwen_moe_dir, tmp_path):
    """The CLI's check, before any engine starts, prints the doctor's plan one line a row —
    alone or skipped, and why — and refuses nothing that one row can run."""
    pytest.importorskip("vllm")
    from skyrl_numerics import cli
    from skyrl_numerics.doctor import engine_memory, model_check
    from test_engine_memory import _fake_memory

    _fake_memory(monkeypatch, 4 * GiB, int(2.9 * GiB))
    monkeypatch.setattr(engine_memory, "free_memory", lambda: (4 * GiB, int(2.9 * GiB)))
    args = cli.build_parser().parse_args(
        ["doctor", "--model", str(qwen_moe_dir), "--out", str(tmp_path / "o"), "--prompts", "2",
         "--prompt-len", "4", "--max-tokens", "3"])
    info = model_check.inspect_checkpoint(qwen_moe_dir)
    from skyrl_numerics.doctor import ROWS

    rows = [r for r in ROWS if r.default and r.name in (
        "baseline: HF trainer, bf16", "+ batch-invariant (trainer and vLLM)",
        "FP8 KV engine: trainer without KV simulation")]
    check = cli._doctor_checks(args, {"dtype": "bfloat16", "max_model_len": 1024}, 1024)
    assert check(info, rows) is None
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("memory: 2.9 GiB free of 4.0 GiB; engines get kv_cache_memory_bytes=")
    assert sum(line.startswith("  + batch-invariant (trainer and vLLM): alone: its engine")
               for line in out) == 1, out
    assert any(line.startswith("  FP8 KV engine: trainer without KV simulation: alone:")
               for line in out), out
    assert [line for line in info.memory_lines if line.startswith("  ")] == out[1:]
    # 1.6 GiB: no engine fits beside the headroom -> every row skipped, each with its sizes;
    # the CLI refuses up front (one error naming the sizes), nothing crashes later
    monkeypatch.setattr(engine_memory, "free_memory", lambda: (4 * GiB, int(1.6 * GiB)))
    plan = engine_memory.announce_plan(info, rows, {"dtype": "bfloat16"}, n_prompts=2, seq_len=7)
    assert set(plan.skipped()) == {r.name for r in rows}
    printed = capsys.readouterr().out
    assert all(f"  {r.name}: skipped: memory: its engine (" in printed for r in rows), printed
    from skyrl_numerics.errors import InputError

    with pytest.raises(InputError, match="will not fit in memory: its smallest row needs"):
        check(info, rows)


def test_invariant_copy_reads_the_checkpoint_one_tensor_at_a_time(qwen_moe_dir, tmp_path):
    """The invariant trainer loads tensor by tensor with plain reads (no whole-checkpoint dict,
    no file mapping): the same tensors as safetensors' load_file, bit for bit; a truncated file
    is refused naming it."""
    import torch
    from safetensors.torch import load_file

    from skyrl_numerics.errors import InputError
    from skyrl_numerics.invariant.base import checkpoint_tensor_names, iter_checkpoint_tensors

    ref = load_file(str(qwen_moe_dir / "model.safetensors"))
    got = dict(iter_checkpoint_tensors(qwen_moe_dir))
    assert list(got) == checkpoint_tensor_names(qwen_moe_dir) and set(got) == set(ref)
    assert all(got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]) for k in ref)
    one = sorted(ref)[3]
    assert list(dict(iter_checkpoint_tensors(qwen_moe_dir, names={one}))) == [one]
    data = (qwen_moe_dir / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-8])
    with pytest.raises(InputError, match="truncated"):
        list(iter_checkpoint_tensors(tmp_path))


def test_room_measured_again_before_loading_and_before_scoring(monkeypatch, info):
    """Other processes may take the room the plan saw: before scoring the engines are closed
    when the memory measured then does not hold the largest copy, and a copy that does not fit
    even with the others freed skips its rows with the sizes (no out-of-memory kill)."""
    from skyrl_numerics.doctor import engine_memory as em
    from skyrl_numerics.doctor import ROWS, DoctorContext, score_rows
    from skyrl_numerics.errors import NotEnoughMemory
    from test_engine_memory import _fake_memory

    models = {"a": 1, "b": 2}
    with pytest.raises(NotEnoughMemory, match=r"memory: copy c needs 3\.5 GiB, 1\.0 GiB free now"):
        em.make_room(models, 3 * GiB, keep=("c",), available=lambda: GiB, what="copy c")
    assert models == {}                                  # the others were freed first
    plan = em.MemoryPlan(20 * GiB, 24 * GiB, [], trainer_bytes={(None, None): 4 * GiB,
                                                                ("float32", None): 8 * GiB})
    assert em.scoring_needs_the_engines_memory(plan, available=8 * GiB)
    assert not em.scoring_needs_the_engines_memory(plan, available=9 * GiB)
    assert not em.scoring_needs_the_engines_memory(None, available=0)
    ctx = DoctorContext(model_dir=info.path, family=info.model_type, info=info, memory=plan)
    rows = [r for r in ROWS if r.name in ROW_NAMES[:2]]
    _fake_memory(monkeypatch, 24 * GiB, 6 * GiB)         # the bf16 copy fits, fp32 does not
    out, _ = score_rows(rows, ctx, {"full": _fake_rollout()}, {r.name: None for r in rows}, {})
    status = {r.name: r.extra["status"] for r in out}
    assert status[ROW_NAMES[0]] == "measured"
    assert status[ROW_NAMES[1]] == ("skipped: memory: its trainer copy (HF float32, with scoring) "
                                    "needs 8.5 GiB, 6.0 GiB free now")
    assert ctx._models == {}


def test_a_scenarios_record_is_fetched_while_its_engine_runs(monkeypatch, fake_engines,
                                                             qwen_moe_dir):
    """Scenario.record(engine, rollout) runs right after sampling, and its rows read the result
    from DoctorContext.recorded: scoring starts no engine (the DeepSeek attribution rows took the
    engine's batch layout from a get_generator call during scoring before)."""
    pytest.importorskip("vllm")
    from skyrl_numerics import doctor
    from skyrl_numerics.doctor.rows import FULL, SCENARIOS, Row, Scenario
    from test_engine_memory import StandIn

    calls = []

    def record(engine, rollout):
        calls.append((engine.name, len(StandIn.log)))
        return {"steps of": id(rollout)}

    def compute(ctx, ro):
        assert ctx.recorded[id(ro)] == {"steps of": id(ro)}
        calls.append(("scored", len(StandIn.log)))
        return np.full(ro.num_response_tokens, -6.2, np.float32)

    monkeypatch.setitem(SCENARIOS, "recorded", Scenario(FULL, record=record,
                                                        engine=dict(capture_routes=True)))
    row = Row("row on a recorded scenario", "recorded", compute)
    monkeypatch.setattr(doctor, "ROWS", [*doctor.ROWS, row])
    StandIn.log, StandIn.made = [], []
    fake_engines(StandIn)
    monkeypatch.setenv("SKYRL_NUMERICS_DOCTOR_PREFETCH", "0")
    res = doctor.run_doctor(rows=[row.name], n_prompts=2, prompt_len=4, max_tokens=3,
                            progress=False, model_dir=qwen_moe_dir)
    assert res.rows[0].extra["status"] == "measured"
    assert calls == [("stock", 1), ("scored", 1)]        # one engine start, before both
