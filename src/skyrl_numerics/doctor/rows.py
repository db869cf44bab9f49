"""The doctor's table: the scenarios the engine samples under (:data:`SCENARIOS`, each a
:class:`Scenario`) and the rows measured on them (:data:`ROWS`, each a :class:`Row`, added with
:func:`register_row`), with the trainers the rows compute their logprobs by (given a
:class:`DoctorContext`). :func:`skyrl_numerics.doctor.run_doctor` runs them; the names are
importable from :mod:`skyrl_numerics.doctor` too.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from skyrl_numerics.doctor.engine_memory import make_room_for
from skyrl_numerics.errors import ContractMismatch, InputError
from skyrl_numerics.hf_config import moe_layout
from skyrl_numerics.rollout import Rollout

FULL = dict(temperature=1.0, top_p=1.0, top_k=0)
TOPK = 20   # the bitwise rows also compare the engine's top-K distribution per position
# ... and every position's full logits row by digest (gap/digest.py): scenario key
# "logits_digest", a VLLMGenerator.generate argument (RemoteGenerator has none: doctor.remote drops it)


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
    # ``record(engine, rollout)``: what the rows need from the engine itself, fetched right after
    # sampling (kept in ``DoctorContext.recorded`` by the rollout), so scoring needs no engine
    record: Callable | None = None
    # > 1: multi-turn trajectories through the toy key-value tool (generate_multiturn; routes as
    # turn deltas), max_tokens per turn; rows are measured on model tokens, per turn too
    turns: int = 1

    def engine_for(self, model_dir) -> dict:
        """``engine`` for the checkpoint at ``model_dir``: a value that depends on the model (a
        callable of the checkpoint dir, e.g. a numerics plan built for its linears) resolved;
        ``capture_routes`` dropped for a dense checkpoint (no router: nothing to capture, and
        its rows that need routes are skipped naming that)."""
        out = {k: (v(Path(model_dir)) if callable(v) else v) for k, v in self.engine.items()}
        if out.get("capture_routes") and moe_layout(json.loads(
                (Path(model_dir) / "config.json").read_text())) is None:
            del out["capture_routes"]
        return out

    def sample(self, engine, prompts, *, max_tokens: int, seed: int, without: tuple = ()):
        """The scenario's rollout from ``engine`` (an in-process generator or a server client);
        ``without``: sampling keys left out (a server has no ``logits_digest``)."""
        sampling = {k: v for k, v in self.sampling.items() if k not in without}
        if self.turns > 1:
            from skyrl_numerics.engine.multiturn import KeyValueEnv

            return engine.generate_multiturn(prompts, KeyValueEnv, max_turns=self.turns,
                                             max_tokens=max_tokens, seed=seed, **sampling)
        return engine.generate(prompts, max_tokens=max_tokens, seed=seed, **sampling)

    def max_seq_len(self, prompt_len: int, max_tokens: int) -> int:
        """The longest sequence the scenario sends (the KV cache the engine needs): the prompt
        and every turn's tokens, with the toy tool's observations between turns."""
        from skyrl_numerics.engine.multiturn import KeyValueEnv

        obs = KeyValueEnv.value_len + 2
        return prompt_len + self.turns * max_tokens + (self.turns - 1) * obs


def longest_sequence(rows, prompt_len: int, max_tokens: int) -> int:
    """The longest sequence any of ``rows``' scenarios sends (the memory plan's ``seq_len``)."""
    return max([prompt_len + max_tokens] + [SCENARIOS[r.scenario].max_seq_len(prompt_len, max_tokens)
                                            for r in rows if r.scenario in SCENARIOS])


def _fake_quant_serving(recipe: str):
    def serve(model_dir: Path) -> Path:
        from skyrl_numerics.engine.serving_checkpoint import cached_fake_quant_checkpoint

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
    "batch-invariant": Scenario({**FULL, "topk_logprobs": TOPK, "logits_digest": True},
                                description="vLLM runs the family's batch-invariant model "
                                "(out-of-tree, over its paged KV cache); its top-"
                                f"{TOPK} logprobs and a digest of its full logits row per token "
                                "kept", engine=dict(batch_invariant=True, capture_routes=True)),
    "full, gate weights": Scenario({**FULL, "gate_weights": True},
                                   description="temperature 1, full vocabulary; the engine's MoE "
                                   "combine weights captured beside the routes (fp16)"),
    "multi-turn tool use": Scenario(FULL, turns=3, description="3 model turns, the toy key-value "
                                    "tool's observations between them (masked), routes captured "
                                    "as turn deltas"),
    "multi-turn, batch-invariant": Scenario({**FULL, "topk_logprobs": TOPK, "logits_digest": True},
                                            turns=3, description="the same trajectories through "
                                            "the batch-invariant model; top-K and full-row digests "
                                            "of every model token",
                                            engine=dict(batch_invariant=True, capture_routes=True)),
    "batch-invariant, FP8 KV": Scenario({**FULL, "logits_digest": True},
                                        description="the batch-invariant model storing its "
                                        "KV cache (MLA: the latent) as FP8 E4M3, per-layer scales",
                                        engine=dict(batch_invariant=True, kv_cache="fp8")),
    "batch-invariant, fp8_ds_mla KV": Scenario({**FULL, "logits_digest": True},
                                               description="the batch-invariant MLA model "
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
    recorded: dict = field(default_factory=dict)   # id(rollout) -> its Scenario.record result

    def hf_model(self, dtype: str | None = None, qat: str | None = None):
        """The HF trainer model, loaded once per (dtype, QAT recipe). ``qat``: experts wrapped
        with ``apply_qat`` in that recipe (the trainer-side match of a quantized server), or
        ``("plan", scenario)``: the published trainer's QAT rules for that serving scenario's
        plan (:func:`serving_plan`, ``published.qat_rules_for``)."""
        dtype = dtype if dtype is not None else self.dtype
        key = (dtype, qat)
        if key not in self._models:
            from skyrl_numerics.models import load_hf_model

            make_room_for(self, key)
            model = load_hf_model(self.model_dir, dtype=dtype)
            if isinstance(qat, tuple) and qat[0] == "plan":   # a serving scenario's plan
                from skyrl_numerics.quant import apply_qat

                apply_qat(model, plan_qat_rules(model, serving_plan(qat[1], self.model_dir)))
            elif qat is not None:
                from skyrl_numerics.quant import apply_qat
                from skyrl_numerics.engine.serving_checkpoint import qat_rules

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
    # ``(cause, row name)``: this row removes ``cause`` from the gap of that row (same scenario);
    # the doctor reports the mean |Δ| it closes (score_rows), the size of that cause
    closes: tuple | None = None


ROWS: list[Row] = []


def check_row_names(names, rows: list) -> None:
    """InputError (field ``row``) naming the first of ``names`` that is none of ``rows``."""
    known = {r.name for r in rows}
    unknown = [n for n in names or () if n not in known]
    if unknown:
        raise InputError(f"unknown doctor row {unknown[0]!r}; the rows are: "
                         + "; ".join(repr(r.name) for r in rows), field="row",
                         index=list(names).index(unknown[0]))


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
register_row(Row("gate weights: + R3 (ids only)", "full, gate weights",
                 _plain_trainer(None, use_routes=True), default=False,
                 note="the engine's experts, the trainer's own gate values for them"))
register_row(Row("+ R3 with gate weights", "full, gate weights",
                 _plain_trainer(None, use_routes=True, use_gates=True), default=False,
                 closes=("recomputed gate weights", "gate weights: + R3 (ids only)"),
                 note="the engine's experts and its combine weights (straight-through gradient)"))
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
register_row(Row("multi-turn: HF trainer", "multi-turn tool use", _plain_trainer(None),
                 note="each turn one request over the whole history; observation tokens masked"))
register_row(Row("multi-turn: + R3 (routes from turn deltas)", "multi-turn tool use",
                 _plain_trainer(None, use_routes=True),
                 note="each position's routes shipped once (RouteTrace), replayed in the trainer"))


def engine_dtype(rollout: Rollout):
    """The torch dtype the engine ran (its execution contract's ``dtype``: e.g. a float32 user
    checkpoint served in float32), so the invariant trainer computes in the same one; None (the
    family's bf16) when the engine reported none."""
    import torch

    name = (rollout.meta.get("engine_contract") or {}).get("dtype")
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    return dt if isinstance(dt, torch.dtype) else None


def _invariant_trainer(kv_cache: str | None = None, plan_of: str | None = None, *,
                       bitwise: bool = True):
    """The family's invariant forward in the trainer; ``kv_cache``: the cache format it simulates
    (the engine's, for a bitwise row; ``None`` against an FP8 engine shows that cause's size);
    ``plan_of``: a serving scenario whose numerics plan (:func:`serving_plan`) it computes.
    ``bitwise``: the row expects every token equal, so it compares the trainer's execution
    contract with the one the engine reported (``rollout.meta["engine_contract"]``) before it
    runs and refuses a difference (:class:`~skyrl_numerics.errors.ContractMismatch`); otherwise
    the contracts are only recorded."""
    key = ("invariant", kv_cache) if plan_of is None else ("invariant", kv_cache, plan_of)

    def contract(ctx: DoctorContext, rollout: Rollout) -> dict | None:
        """Both contracts and their difference (report.json's row ``contract``); None when the
        engine reported none."""
        from skyrl_numerics.invariant.contract import ExecutionContract, of_model

        engine = rollout.meta.get("engine_contract")
        if key not in ctx._models or not isinstance(engine, dict) or "error" in engine:
            return None if engine is None else {"engine": engine}
        trainer, theirs = of_model(ctx._models[key]), ExecutionContract.from_dict(engine, source="engine")
        return {"trainer": trainer.to_dict(), "engine": theirs.to_dict(), "refuses": bitwise,
                "diff": [{"field": f, "trainer": a, "engine": b} for f, a, b in trainer.diff(theirs)]}

    def compute(ctx: DoctorContext, rollout: Rollout) -> np.ndarray:
        from skyrl_numerics.invariant import from_checkpoint
        from skyrl_numerics.trainer.logprobs import invariant_trainer_logprobs

        if key not in ctx._models:
            make_room_for(ctx, key)
            plan = None
            if plan_of is not None:
                from skyrl_numerics.invariant.numerics import NumericsPlan

                plan = NumericsPlan.from_json(serving_plan(plan_of, ctx.model_dir))
            ctx._models[key] = from_checkpoint(ctx.model_dir, kv_cache=kv_cache, numerics=plan,
                                               dtype=engine_dtype(rollout))
        got = contract(ctx, rollout)
        if bitwise and got and got.get("diff"):    # before the trainer's forward runs
            raise ContractMismatch([(d["field"], d["trainer"], d["engine"]) for d in got["diff"]],
                                   what="doctor, before the trainer's forward")
        return invariant_trainer_logprobs(ctx._models[key], rollout).logprobs

    def distribution(ctx: DoctorContext, rollout: Rollout) -> dict:
        """The engine's top-K logprobs vs the invariant forward's rows (gap/topk.py)."""
        from skyrl_numerics.invariant.rollout_forward import invariant_topk

        return invariant_topk(ctx._models[key], rollout)

    def logits_digest(ctx: DoctorContext, rollout: Rollout) -> dict:
        """The engine's full-row digests vs the invariant forward's rows (gap/digest.py). The
        engine may be closed by now: a mismatch names its position, not its token id."""
        from skyrl_numerics.invariant.rollout_forward import invariant_logits_digest

        return invariant_logits_digest(ctx._models[key], rollout)
    compute.distribution, compute.trainer = distribution, key
    compute.logits_digest, compute.contract = logits_digest, contract
    return compute


register_row(Row("+ batch-invariant (trainer and vLLM)", "batch-invariant", _invariant_trainer(),
                 note="one invariant forward on both sides (MLA: absorbed for every position): "
                      "expect every token bitwise equal"))
register_row(Row("multi-turn: batch-invariant (trainer and vLLM)", "multi-turn, batch-invariant",
                 _invariant_trainer(), note="every model token of every turn bitwise equal"))
register_row(Row("FP8 KV engine: trainer without KV simulation", "batch-invariant, FP8 KV",
                 _invariant_trainer(None, bitwise=False),
                 note="invariant engine with an FP8 cache, invariant trainer attending over "
                      "unquantized K/V: the size of the FP8-KV cause alone"))
register_row(Row("+ batch-invariant, FP8 KV (trainer simulates the cache)", "batch-invariant, FP8 KV",
                 _invariant_trainer("fp8"), families=("qwen3_moe", "mixtral", "glm4_moe"),
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


# ---- quantized serving numerics: the invariant engine serving a NumericsPlan -------------------
# W4A4 / W8A8 run on no vLLM CPU kernel; the invariant engine computes them (weights packed as
# codes + scales, activations quantized per token: invariant/numerics.py) and the rows
# split the gap into its causes: the serving formats' rounding (stock -> fake-quant matched) and
# the kernels / formulation (fake-quant matched -> batch-invariant, which computes the same bits)
_W8A8 = "fp8_channel/fp8_token"
SERVING_RECIPES = {
    # Mistral Large 4's formats (seed_recipes.SEED_RECIPES["ml4"]) without its LoRA and FP8 KV cache
    "W4A4 serving": dict(base="ml4", lora_rank=0, kv_cache="auto"),
    # FP8 W8A8 "dynamic" (compressed-tensors FP8_DYNAMIC): per-channel weights, per-token acts
    "W8A8 serving": dict(experts=_W8A8, attention=_W8A8, shared=_W8A8, dense=_W8A8),
}
_PLANS: dict = {}


def serving_recipe(scenario: str):
    """The :class:`~skyrl_numerics.trainer.seed_recipes.SeedRecipe` a serving scenario's engine computes."""
    import dataclasses

    from skyrl_numerics.trainer.seed_recipes import SEED_RECIPES, SeedRecipe

    kw = dict(SERVING_RECIPES[scenario])
    name = scenario.split()[0]
    base = kw.pop("base", None)
    r = SEED_RECIPES[base] if base else SeedRecipe(name)     # the fields as --recipe-set sets them
    return dataclasses.replace(r.with_overrides([f"{k}={v}" for k, v in kw.items()]), name=name)


def serving_plan(scenario: str, model_dir) -> str:
    """The :class:`~skyrl_numerics.invariant.numerics.NumericsPlan` (JSON) of a serving
    scenario on the checkpoint at ``model_dir``, as ``seed_recipes.resolve`` builds it: the groups the
    model lacks dropped; what cannot apply is an ``InputError`` naming the field (a skip reason).
    Cached per scenario and config."""
    import hashlib

    cfg = (Path(model_dir) / "config.json").read_bytes()
    key = (scenario, str(Path(model_dir).resolve()), hashlib.sha256(cfg).hexdigest())
    if key not in _PLANS:
        from skyrl_numerics.trainer.seed_recipes import resolve

        _PLANS[key] = resolve(serving_recipe(scenario), model_dir)[0].to_json()
    return _PLANS[key]


def plan_qat_rules(model, plan_json: str) -> list:
    """The published trainer's ``apply_qat`` rules for a plan, fitted to ``model``
    (:func:`skyrl_numerics.trainer.published.qat_rules_for`; the doctor hands plans
    to its engines as JSON)."""
    from skyrl_numerics.invariant.numerics import NumericsPlan
    from skyrl_numerics.trainer.published import qat_rules_for

    return qat_rules_for(NumericsPlan.from_json(plan_json), model)


class _PlanFor:
    """``Scenario.engine`` value: the scenario's plan for the checkpoint the doctor runs."""

    def __init__(self, scenario: str):
        self.scenario = scenario

    def __call__(self, model_dir: Path) -> str:
        return serving_plan(self.scenario, model_dir)

    def __repr__(self) -> str:
        return f"serving_plan({self.scenario!r}, <model>)"


def _formats(scenario: str) -> str:
    r = serving_recipe(scenario)
    return ", ".join(f"{g} {r.spec(g)}" for g in ("experts", "attention", "shared", "dense")
                     if r.spec(g) != "none/none")


for _sc, _what in (("W4A4 serving", "NVFP4 W4A4 routed experts, FP8 W8A8 attention / shared "
                    "experts / dense MLPs (Mistral Large 4's formats, no LoRA, bf16 KV)"),
                   ("W8A8 serving", "FP8 W8A8 on every linear: per-channel E4M3 weights, "
                    "dynamic per-token E4M3 activations")):
    SCENARIOS[_sc] = Scenario(
        {**FULL, "topk_logprobs": TOPK, "logits_digest": True},
        description=f"the batch-invariant engine serving {_what} ({_formats(_sc)}; WEIGHT/ACT, "
        "groups the model lacks dropped): weights packed as codes + scales, activations "
        "quantized per token", engine=dict(batch_invariant=True, capture_routes=True,
                                           numerics=_PlanFor(_sc)))
    _stock = f"{_sc}: stock trainer"
    register_row(Row(_stock, _sc, _plain_trainer(None),
                     note="HF bf16 trainer, nothing quantized: the whole gap (the serving formats' "
                          "rounding + kernels and formulation)"))
    _fq = f"{_sc}: + fake-quant matched"
    register_row(Row(_fq, _sc, _plain_trainer(None, qat=("plan", _sc)),
                     closes=("quantization", _stock),
                     note="HF trainer with the plan's QAT rules (published.qat_rules_for "
                          "-> apply_qat, fitted to the model: plan_qat_rules): weights on the "
                          "served grid, activations fake-quantized per token as the engine "
                          "quantizes them (fused experts: both GEMM inputs); what it closes is "
                          "the quantization cause"))
    register_row(Row(f"{_sc}: batch-invariant", _sc, _invariant_trainer(plan_of=_sc),
                     closes=("kernels + formulation", _fq),
                     note="the invariant trainer with the same plan (from_checkpoint(numerics=)): "
                          "the engine's codes, scales and per-token activations in one forward, "
                          "every token bitwise equal. It closes what fake-quant leaves: the "
                          "kernels' rounding and the forward's formulation, which per-token "
                          "activation quantization amplifies (a 1-ulp difference at a rounding "
                          "tie moves a value a whole FP8/FP4 step)"))


# ---- a real quantized engine: vLLM's INT4 kernels on a compressed-tensors checkpoint -----------
def _int4_engine_serving(model_dir: Path) -> Path:
    from skyrl_numerics.engine.serving_checkpoint import write_int4_checkpoint

    return write_int4_checkpoint(model_dir)


def _int4_matched_trainer():
    from skyrl_numerics.engine.serving_checkpoint import int4_qat_spec

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
# (skyrl_numerics.doctor.mla_attribution) to the HF trainer.
_MLA_SCENARIO = "full (engine batch layout recorded)"


def _recorded_steps(engine, rollout):
    from skyrl_numerics.doctor.mla_attribution import recorded_steps

    return recorded_steps(engine, rollout)


SCENARIOS[_MLA_SCENARIO] = Scenario(
    FULL, description="temperature 1, full vocabulary; the engine records each step's batch "
    "layout (for the rotary-kernel emulation)",
    engine=dict(capture_routes=True,
                worker_extension_cls="skyrl_numerics.engine.vllm_ext.MLAScheduleExtension"),
    record=_recorded_steps)


def _mla_attribution(pieces: tuple, use_routes: bool = False, prefill: str = "absorbed"):
    def compute(ctx: DoctorContext, rollout: Rollout) -> np.ndarray:
        from skyrl_numerics.engine.generator import get_generator
        from skyrl_numerics.trainer.logprobs import trainer_logprobs
        from skyrl_numerics.doctor.mla_attribution import recorded_steps, vllm_style_hook

        steps = ctx.recorded.get(id(rollout))   # recorded by the doctor right after sampling
        if "cpu_rope" in pieces and steps is None:   # a caller that did not record them
            gen = get_generator(ctx.model_dir, **SCENARIOS[_MLA_SCENARIO].engine)
            steps = ctx.recorded[id(rollout)] = recorded_steps(gen, rollout)
        model = ctx.hf_model(None)
        hook = vllm_style_hook(model, rollout, pieces, prefill=prefill,
                               steps=steps) if pieces else None
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
                worker_extension_cls="skyrl_numerics.engine.vllm_ext.MLARopeFixExtension"))
register_row(Row("engine rotary fixed: HF trainer, bf16", _MLA_FIXED, _mla_attribution(()),
                 default=False, families=_DS,
                 note="the confirmation from the engine side: fix the rotary call instead of "
                      "emulating it"))
register_row(Row("engine rotary fixed: + MLA formulation + MoE numerics + R3", _MLA_FIXED,
                 _mla_attribution(("mla", "router", "moe", "mlp"), use_routes=True),
                 default=False, families=_DS, note="every piece, against the fixed engine"))
# ---- end of the DeepSeek-V3 attribution block ---------------------------------------------------
