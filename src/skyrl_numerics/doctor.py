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

from skyrl_numerics.doctor_engines import _EngineStarts, _room_for_engine, _ServedInPlace  # noqa: F401
from skyrl_numerics.doctor_engines import engine_kinds as _kinds, engine_plan, prefetch_enabled
from skyrl_numerics.engine_memory import make_room_for, plan_for_doctor, release_engines
from skyrl_numerics.rollout import Rollout

FULL = dict(temperature=1.0, top_p=1.0, top_k=0)
TOPK = 20   # the bitwise rows also compare the engine's top-K distribution per position


@dataclass
class Scenario:
    """What the engine does: its sampling parameters, and optionally what it serves
    (``serve(model_dir) -> checkpoint dir``, e.g. experts on an NVFP4 grid)."""
    sampling: dict
    serve: Callable[[Path], Path] | None = None
    description: str = ""
    engine: dict = field(default_factory=dict)   # extra VLLMGenerator arguments
    # ``serve`` changes weight values only (same tensor names, shapes, dtypes, config): the
    # doctor loads them into the running engine in place instead of starting another one, and
    # loads the original weights back after sampling
    weights_only: bool = False
    # vLLM CPU kernels the engine needs (skyrl_numerics.host.FEATURES keys): where the installed
    # build lacks one, the scenario's rows are skipped, naming the kernel and the host ISA
    needs: tuple = ()


def _fake_quant_serving(recipe: str):
    def serve(model_dir: Path) -> Path:
        from skyrl_numerics.trainer.engine.serving_checkpoint import cached_fake_quant_checkpoint

        return cached_fake_quant_checkpoint(model_dir, recipe)
    return serve


SCENARIOS: dict[str, Scenario] = {
    "full": Scenario(FULL, description="temperature 1, full vocabulary"),
    "top-p/top-k": Scenario(dict(temperature=1.0, top_p=0.9, top_k=16, capture_support=True),
                            description="top_p 0.9, top_k 16, support captured"),
    "top-p 0.95 only": Scenario(dict(temperature=1.0, top_p=0.95, top_k=0, capture_support=True),
                                description="top_p 0.95, no top-k; the support the sampler kept "
                                "is captured inside the engine (sparse CSR)"),
    "nvfp4 experts": Scenario(FULL, _fake_quant_serving("nvfp4"),
                              "engine serves MoE experts on the NVFP4 grid (vllm convention), stored "
                              "as bf16 values on the grid: no NVFP4 kernel runs", weights_only=True),
    "int4 experts": Scenario(FULL, _fake_quant_serving("int4_g32"),
                             "engine serves MoE experts on the INT4 g32 grid, stored as bf16 values "
                             "on the grid: no INT4 kernel runs (see 'engine runs INT4 kernels')",
                             weights_only=True),
    "batch-invariant": Scenario({**FULL, "topk_logprobs": TOPK}, description="vLLM runs the "
                                "family's batch-invariant model (out-of-tree, over its paged KV "
                                f"cache); its top-{TOPK} logprobs per token kept",
                                engine=dict(batch_invariant=True, capture_routes=True)),
    "batch-invariant, FP8 KV": Scenario(FULL, description="the batch-invariant model storing its "
                                        "KV cache (MLA: the latent) as FP8 E4M3, per-layer scales",
                                        engine=dict(batch_invariant=True, kv_cache="fp8")),
    "batch-invariant, fp8_ds_mla KV": Scenario(FULL, description="the batch-invariant MLA model "
                                               "storing its latent in the fp8_ds_mla layout (656 B)",
                                               engine=dict(batch_invariant=True,
                                                           kv_cache="fp8_ds_mla")),
}


@dataclass
class DoctorContext:
    model_dir: Path
    family: str
    _models: dict = field(default_factory=dict)
    info: object = None          # model_check.CheckpointInfo of model_dir
    dtype: str | None = None     # trainer dtype for rows asking for None (--dtype; else stored)
    memory: object = None        # engine_memory.MemoryPlan of the run (trainer copies freed by it)

    def hf_model(self, dtype: str | None = None, qat: str | None = None):
        """The HF trainer model, loaded once per (dtype, QAT recipe). ``qat``: experts wrapped
        with ``apply_qat`` in that recipe (the trainer-side match of a quantized server)."""
        dtype = dtype if dtype is not None else self.dtype
        key = (dtype, qat)
        if key not in self._models:
            from skyrl_numerics.models import load_hf_model

            make_room_for(self, key)
            model = load_hf_model(self.model_dir, dtype=dtype)
            if qat is not None:
                from skyrl_numerics.quant import apply_qat
                from skyrl_numerics.trainer.engine.serving_checkpoint import qat_rules

                apply_qat(model, qat_rules(qat))
            self._models[key] = model
        return self._models[key]


@dataclass
class Row:
    name: str
    scenario: str
    compute: Callable[[DoctorContext, Rollout], np.ndarray]  # -> flat trainer logprobs
    note: str = ""
    default: bool = True
    families: tuple = ("qwen3_moe", "deepseek_v3")


ROWS: list[Row] = []


def register_row(row: Row) -> Row:
    """Add (or replace, by name) a row of the ablation table."""
    ROWS[:] = [r for r in ROWS if r.name != row.name]
    ROWS.append(row)
    return row


def _plain_trainer(dtype: str | None, qat: str | None = None, **kw):
    def compute(ctx: DoctorContext, rollout: Rollout) -> np.ndarray:
        from skyrl_numerics.trainer.logprobs import trainer_logprobs

        return trainer_logprobs(ctx.hf_model(dtype, qat), rollout, **kw).logprobs
    compute.uses_routes = bool(kw.get("use_routes"))
    compute.trainer = ("hf", dtype, qat)      # the copy it loads (engine_memory.trainer_key)
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
register_row(Row("top-p 0.95 only: HF trainer, full-vocab", "top-p 0.95 only", _plain_trainer(None),
                 note="top_p alone: the support has no size bound, so it is read from the "
                      "engine's sampler, not from returned logprobs"))
register_row(Row("top-p 0.95 only: + support replay", "top-p 0.95 only",
                 _plain_trainer(None, use_support=True),
                 note="renormalized over the set vLLM's top-p kept (captured in the engine)"))
register_row(Row("top-p 0.95 only: + support replay + R3", "top-p 0.95 only",
                 _plain_trainer(None, use_support=True, use_routes=True), note="both replays"))
def _invariant_trainer(kv_cache: str | None = None):
    """The family's invariant forward in the trainer; ``kv_cache``: the cache format it simulates
    (the engine's, for a bitwise row; ``None`` against an FP8 engine shows that cause's size)."""
    def compute(ctx: DoctorContext, rollout: Rollout) -> np.ndarray:
        from skyrl_numerics.trainer.invariant import from_checkpoint
        from skyrl_numerics.trainer.invariant.base import invariant_trainer_logprobs

        key = ("invariant", kv_cache)
        if key not in ctx._models:
            make_room_for(ctx, key)
            ctx._models[key] = from_checkpoint(ctx.model_dir, kv_cache=kv_cache)
        return invariant_trainer_logprobs(ctx._models[key], rollout).logprobs

    def distribution(ctx: DoctorContext, rollout: Rollout) -> dict:
        """The engine's top-K logprobs vs the invariant forward's rows (gap/topk.py)."""
        from skyrl_numerics.trainer.invariant.base import invariant_topk

        return invariant_topk(ctx._models[("invariant", kv_cache)], rollout)
    compute.distribution, compute.trainer = distribution, ("invariant", kv_cache)
    return compute


register_row(Row("+ batch-invariant (trainer and vLLM)", "batch-invariant", _invariant_trainer(),
                 note="one invariant forward on both sides (MLA: absorbed for every position): "
                      "expect every token bitwise equal"))
register_row(Row("FP8 KV engine: trainer without KV simulation", "batch-invariant, FP8 KV",
                 _invariant_trainer(None),
                 note="invariant engine with an FP8 cache, invariant trainer attending over "
                      "unquantized K/V: the size of the FP8-KV cause alone"))
register_row(Row("+ batch-invariant, FP8 KV (trainer simulates the cache)", "batch-invariant, FP8 KV",
                 _invariant_trainer("fp8"), families=("qwen3_moe",),
                 note="the trainer sends its K/V through the same E4M3 cache format: bitwise"))
register_row(Row("+ batch-invariant, FP8 latent KV (trainer simulates the cache)",
                 "batch-invariant, FP8 KV", _invariant_trainer("fp8"), families=("deepseek_v3",),
                 note="latent [kv_c | k_pe] as E4M3 with the per-layer k_scale "
                      "(concat_and_cache_mla), simulated in the trainer: bitwise"))
register_row(Row("+ batch-invariant, FP8 latent KV fp8_ds_mla (trainer simulates the cache)",
                 "batch-invariant, fp8_ds_mla KV", _invariant_trainer("fp8_ds_mla"),
                 families=("deepseek_v3",), default=False,
                 note="656-byte fp8_ds_mla rows (E4M3 latent, 4 fp32 tile scales, bf16 rope): bitwise"))
for _recipe, _sc in (("nvfp4", "nvfp4 experts"), ("int4_g32", "int4 experts")):
    register_row(Row(f"{_sc}: plain bf16 trainer", _sc, _plain_trainer(None),
                     note=f"trainer keeps bf16 experts; the engine serves the {_recipe} grid"))
    register_row(Row(f"{_sc}: + fake-quant matched", _sc, _plain_trainer(None, qat=_recipe),
                     note=f"apply_qat(experts, {_recipe}) reproduces the served grid bit for bit"))


# ---- a real quantized engine: vLLM's INT4 kernels on a compressed-tensors checkpoint -----------
def _int4_engine_serving(model_dir: Path) -> Path:
    from skyrl_numerics.trainer.engine.serving_checkpoint import write_int4_checkpoint

    return write_int4_checkpoint(model_dir)


def _int4_matched_trainer():
    from skyrl_numerics.trainer.engine.serving_checkpoint import int4_qat_spec

    return _plain_trainer(None, qat=int4_qat_spec())


_INT4_ENGINE = "engine runs INT4 kernels"
SCENARIOS[_INT4_ENGINE] = Scenario(
    FULL, _int4_engine_serving,
    "vLLM serves a compressed-tensors pack-quantized INT4 checkpoint (W4A16, group 32) of the "
    "attention projections through its INT4 kernel (CPU: CPUWNA16LinearKernel); the experts stay "
    "bf16 (vLLM CPU 0.32's INT4 MoE path takes per-channel scales only)", needs=("w4a16",))
register_row(Row(f"{_INT4_ENGINE}: plain trainer", _INT4_ENGINE, _plain_trainer(None),
                 families=("qwen3_moe",),
                 note="trainer keeps bf16 attention projections; the engine runs INT4 codes + scales"))
register_row(Row(f"{_INT4_ENGINE}: + fake-quant matched", _INT4_ENGINE, _int4_matched_trainer(),
                 families=("qwen3_moe",),
                 note="apply_qat(attention projections, int4_g32): the trainer holds the engine's "
                      "codes and scales; what is left is the kernel (bf16 activations, fp32 accumulation)"))


# ---- DeepSeek-V3 gap attribution (docs/mla.md, "Where the DeepSeek-V3 gap comes from") ----------
# One engine whose worker also records each step's batch layout (MLAScheduleExtension): vLLM CPU's
# rotary kernel rotates MLA's q/k views by positions that depend on that layout, and the trainer
# emulates it from the recording. Rows are cumulative, each adds one vLLM-side piece
# (skyrl_numerics.trainer.mla_attribution) to the HF trainer.
_MLA_SCENARIO = "full (engine batch layout recorded)"
SCENARIOS[_MLA_SCENARIO] = Scenario(
    FULL, description="temperature 1, full vocabulary; the engine records each step's batch "
    "layout (for the rotary-kernel emulation)",
    engine=dict(capture_routes=True,
                worker_extension_cls="skyrl_numerics.trainer.engine.vllm_ext.MLAScheduleExtension"))


def _mla_attribution(pieces: tuple, use_routes: bool = False, prefill: str = "absorbed"):
    def compute(ctx: DoctorContext, rollout: Rollout) -> np.ndarray:
        from skyrl_numerics.trainer.engine.generator import get_generator
        from skyrl_numerics.trainer.logprobs import trainer_logprobs
        from skyrl_numerics.trainer.mla_attribution import recorded_steps, vllm_style_hook

        key = ("mla steps", id(rollout))
        if "cpu_rope" in pieces and key not in ctx._models:
            gen = get_generator(ctx.model_dir, **SCENARIOS[_MLA_SCENARIO].engine)
            ctx._models[key] = recorded_steps(gen, rollout)
        model = ctx.hf_model(None)
        hook = vllm_style_hook(model, rollout, pieces, prefill=prefill,
                               steps=ctx._models.get(key)) if pieces else None
        return trainer_logprobs(model, rollout, forward_hook=hook, use_routes=use_routes).logprobs
    return compute


_DS = ("deepseek_v3",)
for _name, _pieces, _kw, _note in (
        ("DeepSeek attribution: HF trainer, bf16", (), {},
         "HF's DeepseekV3 forward (expanded MLA, fp32 gate) on this scenario's rollout"),
        ("+ vLLM CPU rotary kernel on MLA's 3-D q/k (emulated)", ("cpu_rope",), {},
         "the engine rotates query head r%H of token r//H by the position of token r and leaves "
         "later rows unrotated; keys likewise (row stride rope_dim in the fused q_a/kv_a output)"),
        ("+ vLLM's MLA formulation (absorbed, latent cache)", ("cpu_rope", "mla"), {},
         "q_lat = q_nope·W_UK, scores over the latent (c, k_pe), out = (P·c)·W_UV, at prompt "
         "and decoded positions (AMX_MLA absorbs prefill too)"),
        ("+ vLLM's silu_and_mul (dense MLP, shared expert)", ("cpu_rope", "mla", "mlp"), {},
         "silu(g)·u formed in fp32 and rounded once, not three bf16 roundings"),
        ("+ vLLM's gate (bf16 logits) and expert combine",
         ("cpu_rope", "mla", "mlp", "router", "moe"), {},
         "gate logits rounded to bf16; Σ w·y of the routed experts, × routed_scaling_factor, "
         "+ shared"),
        ("+ R3 (router replay), on all of the above", ("cpu_rope", "mla", "router", "moe", "mlp"),
         dict(use_routes=True), "what is left: bf16 rounding order inside vLLM's kernels"),
):
    register_row(Row(_name, _MLA_SCENARIO, _mla_attribution(_pieces, **_kw), note=_note,
                     families=_DS))
register_row(Row("vLLM's MLA formulation alone (no rotary emulation)", _MLA_SCENARIO,
                 _mla_attribution(("mla",)), default=False, families=_DS,
                 note="absorbed MLA with HF's (correct) rope: next to nothing while the rope "
                      "differs"))
register_row(Row("rotary emulated + expanded prefill, absorbed decode", _MLA_SCENARIO,
                 _mla_attribution(("cpu_rope", "mla"), prefill="expanded"), default=False,
                 families=_DS,
                 note="the split CPU_MLA and the GPU backends use; AMX_MLA (here) absorbs both"))
_MLA_FIXED = "full (engine's MLA rotary call fixed)"
SCENARIOS[_MLA_FIXED] = Scenario(
    FULL, description="temperature 1, full vocabulary; vLLM's MLA layers call the CPU rotary "
    "kernel on 2-D copies of q/k (MLARopeFixExtension): every head and key at its own position",
    engine=dict(capture_routes=True,
                worker_extension_cls="skyrl_numerics.trainer.engine.vllm_ext.MLARopeFixExtension"))
register_row(Row("engine rotary fixed: HF trainer, bf16", _MLA_FIXED, _mla_attribution(()),
                 default=False, families=_DS,
                 note="the confirmation from the engine side: fix the rotary call instead of "
                      "emulating it"))
register_row(Row("engine rotary fixed: + MLA formulation + MoE numerics + R3", _MLA_FIXED,
                 _mla_attribution(("mla", "router", "moe", "mlp"), use_routes=True),
                 default=False, families=_DS, note="every piece, against the fixed engine"))
# ---- end of the DeepSeek-V3 attribution block ---------------------------------------------------


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


_GENERIC_FAMILIES = Row.__dataclass_fields__["families"].default


def skip_reason(row: Row, ctx: DoctorContext) -> str | None:
    """Why ``row`` cannot run on ``ctx``'s checkpoint (``None``: it applies)."""
    spec, info = SCENARIOS[row.scenario], ctx.info
    if spec.engine.get("batch_invariant"):
        from skyrl_numerics.trainer.engine.vllm_invariant_model import engine_overrides

        try:
            engine_overrides(info.config, spec.engine.get("kv_cache"))
        except (ValueError, NotImplementedError) as e:  # InputError / UnsupportedConfig
            return f"batch-invariant: {e}"
    if row.families != _GENERIC_FAMILIES and ctx.family not in row.families:
        return f"a row for {', '.join(row.families)} only"
    if spec.serve is not None:
        if not info.is_moe:
            return "dense model: no MoE experts to serve quantized"
        if not info.has_experts_named():
            return "no per-expert weights named *.mlp.experts.<e>.<proj>.weight to fake-quantize"
    if getattr(row.compute, "uses_routes", False) or (spec.engine.get("capture_routes")
                                                       and not info.is_moe):
        if not info.is_moe:
            return "dense model: no MoE router (R3 needs routed experts)"
        from skyrl_numerics.replay.hf_replay import find_routers

        if not find_routers(ctx.hf_model(None)):
            from skyrl_numerics.replay.hf_families import ROUTER_FAMILIES

            return (f"no HF router replay for {info.architecture} "
                    f"(routers with replay: {', '.join(sorted(ROUTER_FAMILIES))})")
    if spec.needs:
        from skyrl_numerics.host import missing_kernel_reason

        return next((w for w in map(missing_kernel_reason, spec.needs) if w), None)
    return None


def _one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:300]}" if msg else type(e).__name__


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``n`` random prompts of ``length`` token ids in [2, vocab) (0/1 are bos/eos)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab, size=length).tolist() for _ in range(n)]


def score_rows(selected: list, ctx: DoctorContext, rollouts: dict, skipped: dict, failed: dict, *,
               no_routes: str | None = None, beside_start: dict | None = None,
               advance: Callable[[str], object] = lambda name: None):
    """Each selected row's trainer logprobs on its scenario's rollout, measured against the
    engine's: ``(report rows, {scenario: rollout with the first row's trainer logprobs})``.
    ``skipped`` / ``failed``: reasons by row name / scenario (the row is listed with them)."""
    from skyrl_numerics.gap import measure
    from skyrl_numerics.report import ReportRow

    import logging

    log = logging.getLogger("skyrl_numerics.doctor")
    beside_start = beside_start or {}
    out_rows, scored = [], {}
    for row in selected:
        why = skipped[row.name]
        if why is None and no_routes and getattr(row.compute, "uses_routes", False):
            why = f"R3: {no_routes}"
        status = f"skipped: {why}" if why else (f"failed: {failed[row.scenario]}"
                                               if row.scenario in failed else None)
        if status is None:
            ro = rollouts[row.scenario]
            try:
                lp = np.asarray(row.compute(ctx, ro), dtype=np.float32)
            except Exception as e:
                log.exception("doctor: row %r failed", row.name)
                status = f"failed: {_one_line(e)}"
        if status is not None:
            out_rows.append(ReportRow(row.name, SkippedReport(status), np.zeros(0, np.float32),
                                      {"scenario": row.scenario, "note": row.note,
                                       "status": status}))
            advance(row.name)
            continue
        report = measure(lp, ro.rollout_logprobs, cu_seqlens=ro.response_cu)
        extra = {"scenario": row.scenario, "note": row.note,
                 "vLLM tok/s": ro.meta.get("tokens_per_s"), "status": "measured"}
        dist = getattr(row.compute, "distribution", None)
        if dist is not None and ro.topk is not None:
            try:
                d = dist(ctx, ro)
                extra[f"top-{d['k']} dist. bitwise ="] = f"{d['frac_bitwise']:.0%}"
                extra["_distribution"] = d
            except Exception as e:
                log.exception("doctor: row %r distribution check failed", row.name)
                extra[f"top-{ro.topk.k} dist. bitwise ="] = f"failed: {_one_line(e)}"
        if beside_start.get(row.scenario):
            extra["_vLLM tok/s mark"] = ("†", "sampled while the next engine started in the "
                                        "background (SKYRL_NUMERICS_DOCTOR_PREFETCH=0: "
                                        "throughput without it)")
        out_rows.append(ReportRow(row.name, report, np.abs(lp - ro.rollout_logprobs), extra))
        # each scenario's rollout is kept with its first row's trainer logprobs, so the
        # written file is a complete dump for `skyrl-numerics gap FILE`
        if row.scenario not in scored:
            scored[row.scenario] = ro.with_trainer_logprobs(lp)
            scored[row.scenario].meta = {**ro.meta, "trainer": row.name}
        advance(row.name)
    return out_rows, scored


def run_doctor(*, family: str = "qwen3_moe", n_prompts: int = 8, prompt_len: int = 16,
               max_tokens: int = 64, seed: int = 0, rows: list[str] | None = None,
               progress: bool = True, model_dir: str | Path | None = None,
               engine_args: dict | None = None, prompts: list | None = None,
               dtype: str | None = None, check: Callable | None = None) -> DoctorResult:
    """Generate with real vLLM and measure every selected row. ``rows``: names (default: all
    rows marked default).

    ``model_dir``: any HF checkpoint (checked by :func:`skyrl_numerics.model_check.
    inspect_checkpoint` before an engine starts; ``family`` is then its ``model_type``); default:
    the tiny ``family`` model. A row that does not apply appears with ``status`` "skipped: why";
    one whose engine or trainer fails, "failed: error". ``engine_args``: extra ``VLLMGenerator``
    / ``vllm.LLM`` arguments for every engine. ``prompts``: token-id lists (default: seeded random
    ids). ``dtype``: the trainer dtype of the rows that keep the stored one. ``check(ckpt,
    selected_rows) -> prompts | None``: called before any engine starts (the CLI's memory and
    prompt checks; returned prompts replace ``prompts``)."""
    import logging

    from rich.progress import Progress

    from skyrl_numerics.model_check import inspect_checkpoint
    from skyrl_numerics.models import build_tiny_model
    from skyrl_numerics.trainer.engine.generator import VLLMGenerator, get_generator

    if rows:
        unknown = set(rows) - {r.name for r in ROWS}
        if unknown:
            raise ValueError(f"unknown doctor rows {sorted(unknown)}; known: "
                             f"{[r.name for r in ROWS]}")
    if model_dir is None:
        model_dir = build_tiny_model(family, seed=seed)
    ekw = dict(engine_args or {})
    ckpt = inspect_checkpoint(model_dir, engine_args=ekw)
    if ckpt.model_type != family:
        family = ckpt.model_type
    # rows made for other families are left out; the generic rows (default ``families``) are
    # listed for every model, and skip_reason() says which of them do not apply
    selected = [r for r in ROWS if (r.name in rows if rows else r.default)
                and (family in r.families or r.families == _GENERIC_FAMILIES)]
    model_dir = ckpt.path
    ctx = DoctorContext(model_dir=model_dir, family=family, info=ckpt, dtype=dtype)
    if check is not None:  # before skip_reason, which may load the HF model
        prompts = check(ckpt, selected) or prompts
    skipped = {r.name: skip_reason(r, ctx) for r in selected}
    mem = plan_for_doctor(ctx, selected, skipped, ekw, prompts=prompts, n_prompts=n_prompts,
                          prompt_len=prompt_len, max_tokens=max_tokens, progress=progress)
    user_ekw, ekw = ekw, {**ekw, **mem.settings}   # engine settings derived from the checkpoint
    scenarios = list(dict.fromkeys(r.scenario for r in selected if skipped[r.name] is None))
    failed: dict[str, str] = {}
    no_routes = None   # why the engine could not capture routes (R3 rows are then skipped)
    log = logging.getLogger("skyrl_numerics.doctor")
    rollouts = {}
    plan, own_scenarios = engine_plan(scenarios, SCENARIOS, model_dir, ekw, VLLMGenerator,
                                      get_generator)
    starts = _EngineStarts(plan, prefetch_enabled(), alone=mem.alone_scenarios)
    beside_start: dict[str, bool] = {}   # scenario sampled while another engine was starting
    hosts, live = [], []   # each engine's own host report (engine_host); the shared engines
    with Progress(disable=not progress, transient=True) as prog:
        task = prog.add_task("starting vLLM engine", total=len(scenarios) + len(selected))
        gen = None
        base_tensors = None   # the model's tensors, read once for the in-place scenarios
        try:
            for i, sc in enumerate(scenarios):
                spec = SCENARIOS[sc]
                prog.update(task, description=f"sampling: {sc}")
                in_place, own = _kinds(spec)
                engine = None
                if sc in mem.alone_scenarios:   # the others closed, trainer copies freed first
                    base_tensors = release_engines(live, ctx._models)
                try:
                    if in_place:   # the shared engine, serving the scenario's weights for a while
                        base = get_generator(model_dir, **ekw, capture_routes=ckpt.is_moe and not no_routes)
                        gen = gen or base
                        live.append(base)
                        served_ip = _ServedInPlace(base, model_dir, spec.serve(model_dir), base_tensors)
                        base_tensors = served_ip.base
                        starts.ahead(scenarios, i, lambda: _room_for_engine(ckpt))
                        with served_ip as engine:
                            hosts.append(getattr(engine, "engine_host", None))
                            engine.generate([[2, 3]], max_tokens=2)   # as every engine: warm-up
                            sc_prompts = prompts or make_prompts(n_prompts, prompt_len,
                                                                 engine.vocab_size, seed)
                            beside_start[sc] = starts.busy()
                            rollouts[sc] = engine.generate(sc_prompts, max_tokens=max_tokens,
                                                           seed=seed, **spec.sampling)
                            beside_start[sc] |= starts.busy()
                        served_ip, base_tensors = None, base_tensors if mem.together else None
                        prog.advance(task)
                        continue
                    if sc in plan:                  # a shared engine variant or an own engine
                        engine = starts.get(sc)
                        if sc not in own_scenarios:
                            gen = gen or engine
                    elif spec.serve is None:
                        try:
                            gen = engine = get_generator(model_dir, **ekw,
                                                         capture_routes=ckpt.is_moe and not no_routes)
                        except RuntimeError as e:  # vLLM's model for this MoE: no router capture hook
                            if not ckpt.is_moe or "route capture" not in str(e):
                                raise
                            log.exception("doctor: route capture unavailable, engine without it")
                            no_routes = _one_line(e)
                            gen = engine = get_generator(model_dir, **ekw, capture_routes=False)
                    starts.ahead(scenarios, i, lambda: _room_for_engine(ckpt))
                    hosts.append(getattr(engine, "engine_host", None))
                    engine.generate([[2, 3]], max_tokens=2)  # warm-up, so tokens/s compares engines
                    sc_prompts = prompts or make_prompts(n_prompts, prompt_len, engine.vocab_size, seed)
                    beside_start[sc] = starts.busy()
                    rollouts[sc] = engine.generate(sc_prompts, max_tokens=max_tokens, seed=seed,
                                                   **spec.sampling)
                    beside_start[sc] |= starts.busy()
                except Exception as e:  # the rows of this scenario show it; the traceback: the log
                    log.exception("doctor: scenario %r failed", sc)
                    failed[sc] = _one_line(e)
                if not own and engine is not None:
                    live.append(engine)
                if own and engine is not None:
                    info = engine.info
                    engine.close()
                prog.advance(task)
        finally:
            starts.close(own_scenarios)   # a start never used (e.g. after an error)
        if mem.release_before_scoring:     # the trainer copies need the engines' memory
            release_engines(live)
        out_rows, scored = score_rows(selected, ctx, rollouts, skipped, failed, no_routes=no_routes,
                                      beside_start=beside_start, advance=lambda name: (
                                          prog.update(task, description=f"trainer: {name}"),
                                          prog.advance(task)))
    settings = dict(family=family, n_prompts=len(prompts) if prompts else n_prompts,
                    prompt_len=None if prompts else prompt_len, prompts="given" if prompts
                    else "seeded random ids", max_tokens=max_tokens, seed=seed,
                    engine_args={k: repr(v) if not isinstance(v, (int, float, str, bool, type(None)))
                                 else v for k, v in user_ekw.items()}, trainer_dtype=dtype,
                    memory=mem.to_dict(),
                    engines_started_ahead=sorted(starts.ahead_started),
                    scenarios={s: {**SCENARIOS[s].sampling,
                                   "description": SCENARIOS[s].description}
                               for s in scenarios})
    if gen is not None:
        info = gen.info
    elif "info" not in locals():  # no engine ran (every row skipped or failed)
        import vllm

        from skyrl_numerics.trainer.engine.generator import EngineInfo

        info = EngineInfo("vllm", vllm.__version__)
    from skyrl_numerics.host import host_info, host_report, vllm_capabilities

    rep = host_report({**host_info(), "vllm_kernels": vllm_capabilities()}, hosts)
    if rep["isa_warning"]:
        log.warning("doctor: %s", rep["isa_warning"])
    return DoctorResult(out_rows, scored, info.name, info.version, model_dir, settings,
                        model=ckpt.to_dict(), host=rep)
