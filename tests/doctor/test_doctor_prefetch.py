"""The doctor starts the next scenario's engine while the current one samples (issue 14): with a
stand-in engine that records where and when it starts, the next engine starts in the background
thread before the current scenario finished sampling, the table is the same as without it, every
own engine is closed once, and nothing starts ahead when memory is short or it is turned off."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from skyrl_numerics import doctor
from skyrl_numerics.rollout import Rollout
from skyrl_numerics.engine.generator import EngineInfo

pytest.importorskip("vllm")  # inspect_checkpoint reads vLLM's model registry

ROWS = ["baseline: HF trainer, bf16", "+ batch-invariant (trainer and vLLM)",
        "FP8 KV engine: trainer without KV simulation"]


class FakeEngine:
    events: list = []

    def __init__(self, model_dir, **kw):
        self.kw = {k: v for k, v in kw.items() if k != "capture_routes"}
        FakeEngine.events.append(("start", repr(sorted(self.kw.items())),
                                  threading.current_thread() is threading.main_thread()))
        time.sleep(0.3)                       # a start takes a while
        self.vocab_size, self.info, self.llm = 512, EngineInfo("fake", "0"), object()
        self.closed = 0

    def generate(self, prompts, *, max_tokens, seed=0, temperature=1.0, top_p=1.0, top_k=0,
                 capture_support=False, **kw):
        if max_tokens > 2:                    # not the warm-up: sampling takes a while too
            time.sleep(0.5)
            FakeEngine.events.append(("sampled", repr(sorted(self.kw.items())), None))
        rng = np.random.default_rng(seed + len(repr(sorted(self.kw.items()))))
        resp = [rng.integers(2, 512, size=max_tokens).tolist() for _ in prompts]
        return Rollout.from_lists(prompts, resp, [[-6.2] * max_tokens for _ in prompts],
                                  sampling=dict(temperature=temperature), engine="fake",
                                  engine_version="0", meta={"tokens_per_s": 1.0})

    def close(self):
        self.closed += 1


def _run(monkeypatch, fake_engines, qwen_moe_dir, room: bool, env: str | None = None):
    FakeEngine.events = []
    made = []

    def vllm_generator(model_dir, **kw):
        made.append(FakeEngine(model_dir, **kw))
        return made[-1]

    fake_engines(vllm_generator)
    monkeypatch.setattr(doctor, "room_for_engine", lambda ckpt: room)
    if env is not None:
        monkeypatch.setenv("SKYRL_NUMERICS_DOCTOR_PREFETCH", env)
    res = doctor.run_doctor(rows=ROWS, n_prompts=2, prompt_len=4, max_tokens=3, progress=False,
                            model_dir=qwen_moe_dir)
    return res, made, list(FakeEngine.events)


def test_next_engine_starts_while_the_current_one_samples(monkeypatch, fake_engines, qwen_moe_dir):
    res, made, ev = _run(monkeypatch, fake_engines, qwen_moe_dir, room=True)
    starts = [e for e in ev if e[0] == "start"]
    assert [s[2] for s in starts] == [True, False, False]      # base here, the next two ahead
    # the batch-invariant engine started before the base engine's scenario finished sampling
    base = starts[0][1]
    assert ev.index(starts[1]) < ev.index(("sampled", base, None))
    fp8 = next(m for m in made if m.kw.get("kv_cache") == "fp8")
    assert fp8.closed == 1 and all(m.closed == 0 for m in made if m is not fp8)   # own: closed once
    assert all(r.extra["status"] == "measured" for r in res.rows)
    # the base engine sampled beside the next engine's start: its tok/s is flagged, in the
    # table (a footnote mark) and in report.json
    d = {r["name"]: r for r in res.to_dict()["rows"]}
    assert d[ROWS[0]]["vLLM tok/s beside an engine start"] is True
    assert not any(k.startswith("_") for r in d.values() for k in r)
    from io import StringIO

    from rich.console import Console

    from skyrl_numerics.doctor.report import render_table

    buf = StringIO()
    render_table(res.rows, "t", console=Console(file=buf, width=400))
    assert "†" in buf.getvalue() and "next engine started in the background" in buf.getvalue()

    res0, made0, ev0 = _run(monkeypatch, fake_engines, qwen_moe_dir, room=True, env="0")
    assert all(e[2] for e in ev0 if e[0] == "start")           # off: every start in line
    assert not any("vLLM tok/s beside an engine start" in r for r in res0.to_dict()["rows"])
    for a, b in zip(res.rows, res0.rows):                       # and the same table
        assert a.name == b.name and a.report.summary() == b.report.summary()


def test_no_start_ahead_without_memory_for_another_engine(monkeypatch, fake_engines, qwen_moe_dir):
    res, made, ev = _run(monkeypatch, fake_engines, qwen_moe_dir, room=False)
    assert all(e[2] for e in ev if e[0] == "start")
    assert len(made) == 3 and all(r.extra["status"] == "measured" for r in res.rows)


def test_engine_starts_failed_start_and_unused_engines():
    """A start that fails raises when its scenario asks for it; an engine started ahead but never
    asked for is closed if it is an own engine (shared ones stay with the process cache)."""
    built = []

    class E:
        def __init__(self, name):
            self.name, self.closed = name, 0
            built.append(self)

        def close(self):
            self.closed += 1

    def boom():
        raise RuntimeError("engine died at start")

    starts = doctor.EngineStarts({"a": lambda: E("a"), "b": boom, "c": lambda: E("c")}, True)
    order = ["x", "a", "b", "c"]
    starts.ahead(order, 0, lambda: True)                        # starts "a"
    assert starts.get("a").name == "a"
    starts.ahead(order, 1, lambda: True)                        # starts "b", which fails
    with pytest.raises(RuntimeError, match="died at start"):
        starts.get("b")
    starts.ahead(order, 2, lambda: True)                        # starts "c", never used
    starts.close(own={"c"})
    assert [(e.name, e.closed) for e in built] == [("a", 0), ("c", 1)]
