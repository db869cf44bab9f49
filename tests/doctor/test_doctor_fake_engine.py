"""run_doctor's bookkeeping with a stand-in engine (no vLLM): route capture unavailable -> R3 rows
skipped with the reason and the engine restarted without it; a failing scenario -> its rows
'failed'; skipped rows are in report.json without a report."""
from __future__ import annotations

import numpy as np
import pytest

from skyrl_numerics import doctor
from skyrl_numerics.rollout import Rollout
from skyrl_numerics.engine.generator import EngineInfo

pytest.importorskip("vllm")  # inspect_checkpoint reads vLLM's model registry


class FakeEngine:
    calls: list = []

    def __init__(self, model_dir, capture_routes=False, **kw):
        FakeEngine.calls.append(dict(capture_routes=capture_routes, **kw))
        if capture_routes:
            raise RuntimeError("Worker failed with error 'route capture: router FooRouter has no "
                               "capture hook'")
        self.vocab_size, self.info, self.llm = 512, EngineInfo("fake", "0"), object()

    def generate(self, prompts, *, max_tokens, seed=0, temperature=1.0, top_p=1.0, top_k=0,
                 capture_support=False, **kw):
        if top_k:
            raise ValueError("this engine cannot do top-k")
        rng = np.random.default_rng(seed)
        resp = [rng.integers(2, 512, size=max_tokens).tolist() for _ in prompts]
        return Rollout.from_lists(prompts, resp, [[-6.2] * max_tokens for _ in prompts],
                                  sampling=dict(temperature=temperature), engine="fake",
                                  engine_version="0", meta={"tokens_per_s": 1.0})


def test_no_route_capture_and_failing_scenario(fake_engines, qwen_moe_dir):
    FakeEngine.calls = []
    fake_engines(FakeEngine)
    rows = ["baseline: HF trainer, bf16", "+ R3 (router replay)",
            "top-p/top-k: + support replay", "top-p/top-k: HF trainer, full-vocab"]
    res = doctor.run_doctor(rows=rows, n_prompts=2, prompt_len=4, max_tokens=3, progress=False,
                            model_dir=qwen_moe_dir)
    st = {r.name: r.extra["status"] for r in res.rows}
    assert st["baseline: HF trainer, bf16"] == "measured"
    assert st["+ R3 (router replay)"].startswith("skipped: R3: RuntimeError: ")
    assert "capture hook" in st["+ R3 (router replay)"]
    assert st["top-p/top-k: HF trainer, full-vocab"] == (
        "failed: ValueError: this engine cannot do top-k")
    assert [c["capture_routes"] for c in FakeEngine.calls] == [True, False]
    d = res.to_dict()
    r3 = next(r for r in d["rows"] if r["name"] == "+ R3 (router replay)")
    assert r3["summary"] == {} and r3["report"]["skipped"].startswith("skipped: R3")
    assert d["model"]["architecture"] == "Qwen3MoeForCausalLM"
    base = next(r for r in d["rows"] if r["name"] == "baseline: HF trainer, bf16")
    assert base["summary"]["n_tokens"] == 6
