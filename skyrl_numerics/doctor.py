"""``skyrl-numerics doctor``: an ablation table of the trainer–engine logprob gap on a tiny MoE.

It builds the tiny model, samples rollouts with the real vLLM engine, recomputes the logprobs with
an HF trainer under several configurations, and reports the gap of each. A configuration is a
:class:`Row`: the scenario the engine samples under (sampling params) and a function computing the
trainer's logprobs for that scenario's rollout. Rollouts are generated once per scenario and shared
by its rows. Later pieces (batch-invariant mode, R3, support replay, matched fake-quant) add rows
with :func:`register_row`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from skyrl_numerics.rollout import Rollout

# scenario name -> sampling parameters given to the engine
SCENARIOS: dict[str, dict] = {
    "full": dict(temperature=1.0, top_p=1.0, top_k=0),
    "top-p/top-k": dict(temperature=1.0, top_p=0.9, top_k=16, capture_support=True),
}


@dataclass
class DoctorContext:
    model_dir: Path
    family: str
    _models: dict = field(default_factory=dict)

    def hf_model(self, dtype: str | None = None):
        """The HF trainer model, loaded once per dtype (None = stored dtype)."""
        if dtype not in self._models:
            from skyrl_numerics.models import load_hf_model

            self._models[dtype] = load_hf_model(self.model_dir, dtype=dtype)
        return self._models[dtype]


@dataclass
class Row:
    name: str
    scenario: str
    compute: Callable[[DoctorContext, Rollout], np.ndarray]  # -> flat trainer logprobs
    note: str = ""
    default: bool = True


ROWS: list[Row] = []


def register_row(row: Row) -> Row:
    """Add (or replace, by name) a row of the ablation table."""
    ROWS[:] = [r for r in ROWS if r.name != row.name]
    ROWS.append(row)
    return row


def _plain_trainer(dtype: str | None, **kw):
    def compute(ctx: DoctorContext, rollout: Rollout) -> np.ndarray:
        from skyrl_numerics.trainer.logprobs import trainer_logprobs

        return trainer_logprobs(ctx.hf_model(dtype), rollout, **kw).logprobs
    return compute


register_row(Row("baseline: HF trainer, bf16", "full", _plain_trainer(None),
                 note="transformers eager forward over prompt+response; fp32 log-softmax"))
register_row(Row("HF trainer, fp32 weights", "full", _plain_trainer("float32"),
                 note="more precision in the trainer does not close the gap: it is a mismatch, "
                      "not noise"))
register_row(Row("+ R3 (router replay)", "full", _plain_trainer(None, use_routes=True),
                 note="every MoE router uses the experts vLLM chose (captured in the engine)"))
register_row(Row("top-p/top-k: HF trainer, full-vocab", "top-p/top-k", _plain_trainer(None),
                 note="the engine samples from a truncated support (top_p=0.9, top_k=16); the "
                      "trainer normalizes over the whole vocabulary"))


register_row(Row("top-p/top-k: + support replay", "top-p/top-k",
                 _plain_trainer(None, use_support=True),
                 note="trainer logprobs renormalized over the support vLLM sampled from"))
register_row(Row("top-p/top-k: + support replay + R3", "top-p/top-k",
                 _plain_trainer(None, use_support=True, use_routes=True),
                 note="both replays"))


@dataclass
class DoctorResult:
    rows: list  # list[report.ReportRow]
    rollouts: dict[str, Rollout]
    engine: str
    engine_version: str
    model_dir: Path
    settings: dict

    def to_dict(self) -> dict:
        return {
            "engine": self.engine, "engine_version": self.engine_version,
            "model_dir": str(self.model_dir), "settings": self.settings,
            "rows": [{"name": r.name, **r.extra, "summary": r.report.summary(),
                      "report": r.report.to_dict()} for r in self.rows],
        }


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``n`` random prompts of ``length`` token ids in [2, vocab) (0/1 are bos/eos)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab, size=length).tolist() for _ in range(n)]


def run_doctor(*, family: str = "qwen3_moe", n_prompts: int = 8, prompt_len: int = 16,
               max_tokens: int = 64, seed: int = 0, rows: list[str] | None = None,
               progress: bool = True) -> DoctorResult:
    """Generate with real vLLM and measure every selected row. ``rows``: names (default: all
    rows marked default)."""
    from rich.progress import Progress

    from skyrl_numerics.gap import measure
    from skyrl_numerics.models import build_tiny_model
    from skyrl_numerics.report import ReportRow
    from skyrl_numerics.trainer.generator import get_generator

    selected = [r for r in ROWS if (r.name in rows if rows else r.default)]
    if rows:
        unknown = set(rows) - {r.name for r in ROWS}
        if unknown:
            raise ValueError(f"unknown doctor rows {sorted(unknown)}; known: "
                             f"{[r.name for r in ROWS]}")
    model_dir = build_tiny_model(family, seed=seed)
    ctx = DoctorContext(model_dir=model_dir, family=family)
    scenarios = list(dict.fromkeys(r.scenario for r in selected))
    out_rows, rollouts = [], {}
    with Progress(disable=not progress, transient=True) as prog:
        task = prog.add_task("starting vLLM engine", total=len(scenarios) + len(selected) + 1)
        gen = get_generator(model_dir, capture_routes=True)
        prog.advance(task)
        for sc in scenarios:
            prog.update(task, description=f"sampling: {sc}")
            prompts = make_prompts(n_prompts, prompt_len, gen.vocab_size, seed)
            rollouts[sc] = gen.generate(prompts, max_tokens=max_tokens, seed=seed,
                                        **SCENARIOS[sc])
            prog.advance(task)
        for row in selected:
            prog.update(task, description=f"trainer: {row.name}")
            ro = rollouts[row.scenario]
            lp = np.asarray(row.compute(ctx, ro), dtype=np.float32)
            report = measure(lp, ro.rollout_logprobs, cu_seqlens=ro.response_cu)
            extra = {"scenario": row.scenario, "note": row.note}
            out_rows.append(ReportRow(row.name, report, np.abs(lp - ro.rollout_logprobs), extra))
            prog.advance(task)
    settings = dict(family=family, n_prompts=n_prompts, prompt_len=prompt_len,
                    max_tokens=max_tokens, seed=seed,
                    scenarios={s: SCENARIOS[s] for s in scenarios})
    return DoctorResult(out_rows, rollouts, gen.info.name, gen.info.version, model_dir, settings)
