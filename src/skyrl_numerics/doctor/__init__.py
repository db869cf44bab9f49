"""``skyrl-numerics doctor``: an ablation table of the trainer–engine logprob gap on a tiny MoE.

It builds the tiny model, samples rollouts with the real vLLM engine, recomputes the logprobs with
an HF trainer under several configurations, and reports the gap of each. A configuration is a
:class:`Row`: the scenario the engine samples under (sampling params) and a function computing the
trainer's logprobs for that scenario's rollout. Rollouts are generated once per scenario and shared
by its rows. Later pieces (batch-invariant mode, R3, support replay, matched fake-quant) add rows
with :func:`register_row`. The scenarios, rows and their trainers are
:mod:`skyrl_numerics.doctor.rows`'s; this module runs them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from skyrl_numerics.doctor.engines import EngineStarts, ServedInPlace, room_for_engine
from skyrl_numerics.doctor.engines import engine_kinds, engine_plan, prefetch_enabled
from skyrl_numerics.doctor.rows import (FULL, ROWS, SCENARIOS, TOPK, DoctorContext, Row, Scenario,
                                        check_row_names, register_row)
from skyrl_numerics.doctor.engine_memory import (plan_for_doctor, release_engines,
                                                 scoring_needs_the_engines_memory)
from skyrl_numerics.doctor.model_check import inspect_checkpoint
from skyrl_numerics.engine import generator as engine_generator
from skyrl_numerics.errors import ContractMismatch, NotEnoughMemory
from skyrl_numerics.host import host_info, host_report, vllm_capabilities, vllm_version
from skyrl_numerics.kernels import cpu_gemm_amx
from skyrl_numerics.models import build_tiny_model
from skyrl_numerics.rollout import Rollout
from skyrl_numerics.rollout.prompts import make_prompts
from skyrl_numerics.doctor.trainer_memory import copy_name, release_copy, scoring_order

# the doctor's public API (rows are registered with register_row; FULL / TOPK are the scenarios)
__all__ = ["run_doctor", "score_rows", "skip_reason", "register_row", "Row", "Scenario", "ROWS",
           "SCENARIOS", "FULL", "TOPK", "DoctorContext", "DoctorResult", "SkippedReport"]

DIGEST_KEY = "full distribution bitwise ="   # the report column of the full-row digest check
LOG = logging.getLogger("skyrl_numerics.doctor")


@dataclass
class DoctorResult:
    rows: list  # list[report.ReportRow]
    rollouts: dict[str, Rollout]
    engine: str
    engine_version: str
    model_dir: Path
    settings: dict
    model: dict = field(default_factory=dict)  # path, architecture, config hash, MoE, params
    # host, engine_host, isa_mismatch, isa_warning (skyrl_numerics.host.host_report)
    host: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "engine": self.engine, "engine_version": self.engine_version,
            "model_dir": str(self.model_dir), "model": self.model, "settings": self.settings,
            **self.host,
            "rows": [{"name": r.name, **{k: v for k, v in r.extra.items() if not k.startswith("_")},
                      **({"vLLM tok/s beside an engine start": True}
                         if r.extra.get("_vLLM tok/s mark") else {}),
                      **({"distribution": r.extra["_distribution"]}
                         if "_distribution" in r.extra else {}),
                      **({"logits_digest": r.extra["_logits_digest"]}
                         if "_logits_digest" in r.extra else {}),
                      **({"cause": r.extra["_cause"]} if "_cause" in r.extra else {}),
                      **({"contract": r.extra["_contract"]} if "_contract" in r.extra else {}),
                      "summary": r.report.summary(), "report": r.report.to_dict()}
                     for r in self.rows],
        }


class SkippedReport:
    """Stands in for a GapReport in a row that did not run (``reason`` says why)."""

    def __init__(self, reason: str):
        self.reason = reason

    def summary(self) -> dict:
        return {}

    def to_dict(self) -> dict:
        return {"skipped": self.reason}


GENERIC_FAMILIES = Row.__dataclass_fields__["families"].default


def skip_reason(row: Row, ctx: DoctorContext, *, load: bool = True) -> str | None:
    """Why ``row`` cannot run on ``ctx``'s checkpoint (``None``: it applies). ``load=False``:
    what the config, the weight names and the host tell, without loading the HF model (whose
    routers R3 needs)."""
    spec, info = SCENARIOS[row.scenario], ctx.info
    if spec.engine.get("batch_invariant"):
        from skyrl_numerics.engine.vllm_invariant_model import engine_overrides

        try:
            engine_overrides(info.config, spec.engine.get("kv_cache"))
        except (ValueError, NotImplementedError) as e:  # InputError / UnsupportedConfig
            return f"batch-invariant: {e}"
        if "numerics" in spec.engine:   # the scenario's plan, built for this model and checked
            try:
                engine_overrides(info.config, spec.engine.get("kv_cache"),
                                 spec.engine_for(ctx.model_dir)["numerics"])
            except (ValueError, NotImplementedError) as e:
                return f"{row.scenario}: {e}"
    elif not spec.engine.get("model_impl"):
        from skyrl_numerics.engine.arch_check import stock_blocked_reason, stock_config_problem

        why = stock_blocked_reason(info.architecture)
        if why:
            return why
        bad = stock_config_problem(info.config)
        if bad:
            return f"{bad[0]}: {bad[1]}"
    if row.families != GENERIC_FAMILIES and ctx.family not in row.families:
        return f"a row for {', '.join(row.families)} only"
    if spec.serve is not None:
        if not info.is_moe:
            return "dense model: no MoE experts to serve quantized"
        if not info.has_experts_named():
            return "no per-expert weights named *.mlp.experts.<e>.<proj>.weight to fake-quantize"
    if getattr(row.compute, "uses_routes", False):
        if not info.is_moe:
            return "dense model: no MoE router (R3 needs routed experts)"
        from skyrl_numerics.replay.hf_replay import find_routers

        if load and not find_routers(ctx.hf_model(None)):
            from skyrl_numerics.replay.hf_families import ROUTER_FAMILIES

            return (f"no HF router replay for {info.architecture} "
                    f"(routers with replay: {', '.join(sorted(ROUTER_FAMILIES))})")
    if spec.needs:
        from skyrl_numerics.host import missing_kernel_reason

        return next((w for w in map(missing_kernel_reason, spec.needs) if w), None)
    return None


def _plan_setting(spec: Scenario, model_dir) -> dict:
    """``{"numerics": plan}`` of a scenario whose engine serves a numerics plan (report.json)."""
    if "numerics" not in spec.engine:
        return {}
    import json

    return {"numerics": json.loads(spec.engine_for(model_dir)["numerics"])}


def one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:300]}" if msg else type(e).__name__


def _measured_row(row: Row, ctx: DoctorContext, ro: Rollout, lp: np.ndarray, beside_start: dict):
    """The report row of ``row``'s trainer logprobs ``lp`` against the engine's (and, for a row
    with a ``distribution`` check, the engine's top-K against the trainer's, while its copy is
    still loaded)."""
    from skyrl_numerics.gap import measure
    from skyrl_numerics.doctor.report import ReportRow

    turn_kw = {"mask": ro.loss_mask, "turns": ro.turns} if ro.is_multi_turn else {}
    report = measure(lp, ro.rollout_logprobs, cu_seqlens=ro.response_cu, **turn_kw)
    extra = {"scenario": row.scenario, "note": row.note,
             "vLLM tok/s": ro.meta.get("tokens_per_s"), "status": "measured"}
    if ro.is_multi_turn and "route_bytes" in ro.meta:
        rb = ro.meta["route_bytes"]
        extra["route kB (turn deltas / full resend)"] = (
            f"{rb['delta'] / 1e3:.1f} / {rb['full_resend'] / 1e3:.1f}")
    dist = getattr(row.compute, "distribution", None)
    if dist is not None and ro.topk is not None:
        try:
            d = dist(ctx, ro)
            extra[f"top-{d['k']} dist. bitwise ="] = f"{d['frac_bitwise']:.0%}"
            extra["_distribution"] = d
        except Exception as e:
            LOG.exception("doctor: row %r distribution check failed", row.name)
            extra[f"top-{ro.topk.k} dist. bitwise ="] = f"failed: {one_line(e)}"
    digest = getattr(row.compute, "logits_digest", None)
    if digest is not None and getattr(ro, "logits_digest", None) is not None:
        try:   # every position's whole logits row, by digest (gap/digest.py)
            g = digest(ctx, ro)
            extra[DIGEST_KEY] = f"{g['frac_bitwise']:.0%}"
            extra["_logits_digest"] = g
        except Exception as e:
            LOG.exception("doctor: row %r logits digest check failed", row.name)
            extra[DIGEST_KEY] = f"failed: {one_line(e)}"
    extra.update(_contract_extra(row, ctx, {row.scenario: ro}))
    if beside_start.get(row.scenario):
        extra["_vLLM tok/s mark"] = ("†", "sampled while the next engine started in the "
                                    "background (SKYRL_NUMERICS_DOCTOR_PREFETCH=0: "
                                    "throughput without it)")
    return ReportRow(row.name, report, np.abs(lp - ro.rollout_logprobs)[ro.model_mask], extra)


def _contract_extra(row: Row, ctx: DoctorContext, rollouts: dict) -> dict:
    """``{"_contract": ...}`` for a row that compares execution contracts (report.json's row
    ``contract``: both sides, their difference); ``{}`` otherwise."""
    contract, ro = getattr(row.compute, "contract", None), rollouts.get(row.scenario)
    got = contract(ctx, ro) if contract is not None and ro is not None else None
    return {"_contract": got} if got else {}


CAUSE_KEY = "cause closed (mean |Δ|)"   # the report column of a row's ``closes``


def _causes(selected: list, out_rows: list) -> None:
    """For each measured row that ``closes`` a cause of another measured row: the mean |Δ| it
    removes (that row's minus its own) — the size of the cause — as a column and as ``cause``
    in report.json (with both means)."""
    by_name = {r.name: out for r, out in zip(selected, out_rows)}
    for row, out in zip(selected, out_rows):
        ref = by_name.get(row.closes[1]) if row.closes else None
        if ref is None or out.extra.get("status") != "measured" or ref.extra.get("status") != "measured":
            continue
        before, after = ref.report.summary()["mean_abs"], out.report.summary()["mean_abs"]
        out.extra[CAUSE_KEY] = f"{row.closes[0]}: {before - after:.2e}"
        out.extra["_cause"] = {"cause": row.closes[0], "vs": row.closes[1],
                               "mean_abs_before": before, "mean_abs_after": after,
                               "closed": before - after}


def score_rows(selected: list, ctx: DoctorContext, rollouts: dict, skipped: dict, failed: dict, *,
               no_routes: str | None = None, beside_start: dict | None = None,
               advance: Callable[[str], object] = lambda name: None):
    """Each selected row's trainer logprobs on its scenario's rollout, measured against the
    engine's: ``(report rows in table order, {scenario: rollout with the first row's trainer
    logprobs})``. The rows are computed copy by copy and each trainer copy is freed after its
    last row (:func:`~skyrl_numerics.doctor.trainer_memory.scoring_order`). ``skipped`` / ``failed``:
    reasons by row name / scenario (the row is listed with them)."""
    from skyrl_numerics.doctor.report import ReportRow

    beside_start = beside_start or {}
    results: dict[int, object] = {}
    lps: dict[int, np.ndarray] = {}
    # copy by copy, each trainer copy freed after its last row: one copy in memory at a time
    order, frees = scoring_order(selected, ctx.dtype)
    for i in order:
        row = selected[i]
        why = skipped[row.name]
        if why is None and no_routes and getattr(row.compute, "uses_routes", False):
            why = f"R3: {no_routes}"
        status = f"skipped: {why}" if why else (f"failed: {failed[row.scenario]}"
                                               if row.scenario in failed else None)
        if status is None:
            ro = rollouts[row.scenario]
            try:
                lp = np.asarray(row.compute(ctx, ro), dtype=np.float32)
            except NotEnoughMemory as e:   # measured before loading its copy: nothing ran
                LOG.warning("doctor: row %r skipped: %s", row.name, e)
                status = f"skipped: {e}"
            except ContractMismatch as e:  # the trainer's forward did not run
                LOG.warning("doctor: row %r refused: %s", row.name, e)
                status = f"refused: {e}"
            except Exception as e:
                LOG.exception("doctor: row %r failed", row.name)
                status = f"failed: {one_line(e)}"
        if status is not None:
            results[i] = ReportRow(row.name, SkippedReport(status), np.zeros(0, np.float32),
                                   {"scenario": row.scenario, "note": row.note,
                                    "status": status, **_contract_extra(row, ctx, rollouts)})
        else:
            results[i], lps[i] = _measured_row(row, ctx, ro, lp, beside_start), lp
        if i in frees and release_copy(ctx._models, frees[i]):
            LOG.info("doctor: trainer copy %s freed after its last row", copy_name(frees[i]))
        advance(row.name)
    out_rows, scored = [results[i] for i in range(len(selected))], {}
    _causes(selected, out_rows)
    for i, row in enumerate(selected):
        # each scenario's rollout is kept with its first row's trainer logprobs, so the
        # written file is a complete dump for `skyrl-numerics gap FILE`
        if i in lps and row.scenario not in scored:
            ro = rollouts[row.scenario]
            scored[row.scenario] = ro.with_trainer_logprobs(lps[i])
            scored[row.scenario].meta = {**ro.meta, "trainer": row.name}
    return out_rows, scored


def run_doctor(*, family: str = "qwen3_moe", n_prompts: int = 8, prompt_len: int = 16,
               max_tokens: int = 64, seed: int = 0, rows: list[str] | None = None,
               progress: bool = True, model_dir: str | Path | None = None,
               engine_args: dict | None = None, prompts: list | None = None,
               dtype: str | None = None, check: Callable | None = None) -> DoctorResult:
    """Generate with real vLLM and measure every selected row. ``rows``: names (default: all
    rows marked default).

    ``model_dir``: any HF checkpoint (checked by :func:`skyrl_numerics.doctor.model_check.
    inspect_checkpoint` before an engine starts; ``family`` is then its ``model_type``); default:
    the tiny ``family`` model. A row that does not apply appears with ``status`` "skipped: why";
    one whose engine or trainer fails, "failed: error". ``engine_args``: extra ``VLLMGenerator``
    / ``vllm.LLM`` arguments for every engine. ``prompts``: token-id lists (default: seeded random
    ids). ``dtype``: the trainer dtype of the rows that keep the stored one. ``check(ckpt,
    selected_rows) -> prompts | None``: called before any engine starts (the CLI's memory and
    prompt checks; returned prompts replace ``prompts``)."""
    from rich.progress import Progress

    user_ekw = dict(engine_args or {})
    ctx, selected, prompts = _doctor_inputs(family, rows, seed, model_dir, user_ekw, dtype,
                                            check, prompts)
    skipped = {r.name: skip_reason(r, ctx) for r in selected}
    mem = plan_for_doctor(ctx, selected, skipped, user_ekw, prompts=prompts, n_prompts=n_prompts,
                          prompt_len=prompt_len, max_tokens=max_tokens, progress=progress)
    scenarios = list(dict.fromkeys(r.scenario for r in selected if skipped[r.name] is None))
    run = DoctorRun(ctx, {**user_ekw, **mem.settings}, mem, prompts, n_prompts, prompt_len,
                    max_tokens, seed)   # engine settings derived from the checkpoint
    with Progress(disable=not progress, transient=True) as prog:
        task = prog.add_task("starting vLLM engine", total=len(scenarios) + len(selected))
        run.sample_all(scenarios, prog, task)
        if scoring_needs_the_engines_memory(mem):   # the trainer copies need the engines' memory
            release_engines(run.live)
        out_rows, scored = score_rows(selected, ctx, run.rollouts, skipped, run.failed,
                                      no_routes=run.no_routes, beside_start=run.beside_start,
                                      advance=lambda name: (
                                          prog.update(task, description=f"trainer: {name}"),
                                          prog.advance(task)))
    info = run.engine_info()
    return DoctorResult(out_rows, scored, info.name, info.version, ctx.model_dir,
                        run.settings(scenarios, user_ekw, dtype), model=ctx.info.to_dict(),
                        host=_host_report(run.hosts))


def _doctor_inputs(family: str, rows, seed: int, model_dir, ekw: dict, dtype, check, prompts):
    """Check the row names and the checkpoint (default: the tiny ``family`` model, built), and
    select the rows for its family; ``(context, selected rows, prompts)`` (``check`` may replace
    the prompts)."""
    check_row_names(rows, ROWS)
    if model_dir is None:
        model_dir = build_tiny_model(family, seed=seed)
    ckpt = inspect_checkpoint(model_dir, engine_args=ekw)
    family = ckpt.model_type
    # rows made for other families are left out; the generic rows (default ``families``) are
    # listed for every model, and skip_reason() says which of them do not apply
    selected = [r for r in ROWS if (r.name in rows if rows else r.default)
                and (family in r.families or r.families == GENERIC_FAMILIES)]
    ctx = DoctorContext(model_dir=ckpt.path, family=family, info=ckpt, dtype=dtype)
    if check is not None:  # before skip_reason, which may load the HF model
        prompts = check(ckpt, selected) or prompts
    return ctx, selected, prompts


def engine_contract(engine) -> dict | None:
    """The execution contract the engine's worker reports (``to_dict``), ``{"error": why}`` when
    it cannot, None for an engine without the method (a stand-in)."""
    ask = getattr(engine, "contract", None)
    if ask is None:
        return None
    try:
        return ask().to_dict()
    except Exception as e:   # the bitwise rows then run without the check, saying so
        LOG.warning("doctor: the engine reported no execution contract: %s", one_line(e))
        return {"error": one_line(e)}


def _host_report(hosts: list) -> dict:
    """This host beside each engine's own report; the ISA warning logged."""
    rep = host_report({**host_info(), "vllm_kernels": vllm_capabilities()}, hosts)
    if rep["isa_warning"]:
        LOG.warning("doctor: %s", rep["isa_warning"])
    rep["gemm_bf16"], rep["gemm_advice"] = cpu_gemm_amx.arithmetic(), cpu_gemm_amx.advice()
    if rep["gemm_advice"]:
        LOG.warning("doctor: %s", rep["gemm_advice"])
    return rep


@dataclass
class DoctorRun:
    """One :func:`run_doctor`'s engines and rollouts while its scenarios sample: shared engines
    stay resident (``live``), own engines are closed once sampled, in-place scenarios borrow the
    shared engine, the next engine starts ahead (``starts``)."""
    ctx: DoctorContext
    ekw: dict                         # engine arguments: the user's + the memory plan's
    mem: Any                          # engine_memory.MemoryPlan
    prompts: list | None
    n_prompts: int
    prompt_len: int
    max_tokens: int
    seed: int
    plan: dict = field(default_factory=dict)        # scenario -> build() of its engine
    own_scenarios: set = field(default_factory=set)
    starts: EngineStarts | None = None
    gen: Any = None                   # the first shared engine: the report's engine
    closed_info: Any = None           # EngineInfo of the last own engine closed
    base_tensors: dict | None = None  # the model's tensors, read once for in-place scenarios
    no_routes: str | None = None      # why the engine could not capture routes (R3 skipped)
    live: list = field(default_factory=list)       # the shared engines
    hosts: list = field(default_factory=list)      # each engine's own host report
    beside_start: dict = field(default_factory=dict)   # sampled while an engine was starting
    failed: dict = field(default_factory=dict)     # scenario -> one-line error
    rollouts: dict = field(default_factory=dict)   # scenario -> Rollout

    def sample_all(self, scenarios: list, prog, task) -> None:
        """Every scenario's rollout, in order (a failure is kept in ``failed``); engines started
        ahead and never used are closed."""
        self.plan, self.own_scenarios = engine_plan(
            scenarios, SCENARIOS, self.ctx.model_dir, self.ekw, engine_generator.VLLMGenerator,
            engine_generator.get_generator)
        self.starts = EngineStarts(self.plan, prefetch_enabled(), alone=self.mem.alone_scenarios)
        try:
            for i, sc in enumerate(scenarios):
                prog.update(task, description=f"sampling: {sc}")
                self.sample_scenario(scenarios, i)
                prog.advance(task)
        finally:
            self.starts.close(self.own_scenarios)   # a start never used (e.g. after an error)

    def sample_scenario(self, scenarios: list, i: int) -> None:
        sc = scenarios[i]
        spec = SCENARIOS[sc]
        in_place, own = engine_kinds(spec)
        engine = None
        if sc in self.mem.alone_scenarios:   # the others closed, trainer copies freed first
            self.base_tensors = release_engines(self.live, self.ctx._models)
        try:
            if in_place:   # the shared engine, serving the scenario's weights for a while
                self._sample_in_place(scenarios, i, spec)
                return
            engine = self._engine(sc, spec)
            self.starts.ahead(scenarios, i, lambda: room_for_engine(self.ctx.info))
            self._sample(engine, sc, spec)
            if spec.record is not None:   # while the engine runs: scoring needs none
                self.ctx.recorded[id(self.rollouts[sc])] = spec.record(engine, self.rollouts[sc])
        except Exception as e:  # the rows of this scenario show it; the traceback: the log
            LOG.exception("doctor: scenario %r failed", sc)
            self.failed[sc] = one_line(e)
        if engine is not None and not own:
            self.live.append(engine)
        if engine is not None and own:
            self.closed_info = engine.info
            engine.close()

    def _shared(self, capture_routes):
        return engine_generator.get_generator(self.ctx.model_dir, **self.ekw,
                                              capture_routes=capture_routes)

    def _engine(self, sc: str, spec: Scenario):
        """The scenario's engine: planned (a shared variant or its own, maybe started ahead),
        else the shared stock engine, without route capture if vLLM's model has no hook."""
        if sc in self.plan:
            engine = self.starts.get(sc)
            if sc not in self.own_scenarios:
                self.gen = self.gen or engine
            return engine
        if spec.serve is not None:
            return None
        try:
            self.gen = self._shared(self.ctx.info.is_moe and not self.no_routes)
        except RuntimeError as e:  # vLLM's model for this MoE: no router capture hook
            if not self.ctx.info.is_moe or "route capture" not in str(e):
                raise
            LOG.exception("doctor: route capture unavailable, engine without it")
            self.no_routes = one_line(e)
            self.gen = self._shared(False)
        return self.gen

    def _sample_in_place(self, scenarios: list, i: int, spec: Scenario) -> None:
        """The shared engine serving the scenario's checkpoint in place while it samples."""
        base = self._shared(self.ctx.info.is_moe and not self.no_routes)
        self.gen = self.gen or base
        self.live.append(base)
        served = ServedInPlace(base, self.ctx.model_dir, spec.serve(self.ctx.model_dir),
                               self.base_tensors)
        self.base_tensors = served.base
        self.starts.ahead(scenarios, i, lambda: room_for_engine(self.ctx.info))
        with served as engine:
            self._sample(engine, scenarios[i], spec)
        if not self.mem.together:
            self.base_tensors = None

    def _sample(self, engine, sc: str, spec: Scenario) -> None:
        """Warm the engine up (so tokens/s compares engines), then sample the scenario."""
        self.hosts.append(getattr(engine, "engine_host", None))
        contract = engine_contract(engine)
        engine.generate([[2, 3]], max_tokens=2)
        sc_prompts = self.prompts or make_prompts(self.n_prompts, self.prompt_len,
                                                  engine.vocab_size, self.seed)
        self.beside_start[sc] = self.starts.busy()
        self.rollouts[sc] = spec.sample(engine, sc_prompts, max_tokens=self.max_tokens,
                                        seed=self.seed)
        if contract is not None:    # what the engine's worker ran (its rows compare it)
            self.rollouts[sc].meta["engine_contract"] = contract
        self.beside_start[sc] |= self.starts.busy()

    def engine_info(self):
        """The report's engine: the shared one, else the last own engine, else vLLM's version
        (no engine ran: every row skipped or failed)."""
        if self.gen is not None:
            return self.gen.info
        return self.closed_info or engine_generator.EngineInfo("vllm", vllm_version())

    def settings(self, scenarios: list, user_ekw: dict, dtype) -> dict:
        """report.json's ``settings``."""
        prompts = self.prompts
        return dict(family=self.ctx.family, n_prompts=len(prompts) if prompts else self.n_prompts,
                    prompt_len=None if prompts else self.prompt_len,
                    prompts="given" if prompts else "seeded random ids",
                    max_tokens=self.max_tokens, seed=self.seed,
                    engine_args={k: repr(v) if not isinstance(v, (int, float, str, bool, type(None)))
                                 else v for k, v in user_ekw.items()}, trainer_dtype=dtype,
                    memory=self.mem.to_dict(),
                    engines_started_ahead=sorted(self.starts.ahead_started),
                    scenarios={s: {**SCENARIOS[s].sampling,
                                   "description": SCENARIOS[s].description,
                                   **_plan_setting(SCENARIOS[s], self.ctx.model_dir)}
                               for s in scenarios})
