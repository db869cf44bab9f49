"""How much memory a vLLM CPU engine of a checkpoint takes, the setting that makes it take that
much, and which doctor rows fit the machine together, one at a time, or not at all.

The arithmetic (``B`` = bytes; every input read from ``config.json`` and the safetensors headers,
nothing loaded):

- **weights** ``W = Σ numel(tensor) × bytes(engine dtype)`` over the checkpoint's tensors
  (:func:`checkpoint_params`); ``auto`` counts the stored dtype. The batch-invariant engine and
  trainer hold ``INVARIANT_WEIGHT_FACTOR × W``.
- **KV cache**, per token and layer (:func:`kv_layout`):
  GQA ``2 × num_key_value_heads × head_dim × bytes(kv dtype)``; MLA (DeepSeek-V3 family, a config
  with ``kv_lora_rank``) one latent row ``(kv_lora_rank + qk_rope_head_dim) × bytes(kv dtype)``.
  The batch-invariant model stores its row (``row_bytes``: the same widths, or 1 B per element for
  ``fp8``, 656 B for ``fp8_ds_mla``) in a slot of ``2 × ⌈row_bytes / (2·64·item)⌉ × 64 × item``
  bytes (``item`` = model dtype bytes; ``vllm_invariant_model.py``).
- **tokens** (:func:`kv_tokens`), in blocks of the engine's ``block_size`` (vLLM CPU: 128; its
  reference MLA kernel on a host without AMX: 16):
  ``blocks = ⌈S × max(prompts × ⌈(prompt + new) / bs⌉, ⌈max_model_len / bs⌉)⌉ + 1`` — the run's
  sequences, or one ``max_model_len`` request if longer (vLLM refuses a cache that cannot hold
  one), times the safety factor ``S = KV_SAFETY``, plus the null block vLLM holds back;
  ``KV = layers × blocks × bs × bytes per token and layer``.
- **engine** ``E = INVARIANT_WEIGHT_FACTOR^(invariant) × W + KV + ENGINE_OVERHEAD`` (the EngineCore
  and worker processes' interpreters and libraries: measured 1.17 GiB of ``MemAvailable`` for the
  tiny Qwen3-MoE, EngineCore 0.64 GB + worker 0.73 GB RSS).

Which knob vLLM 0.32 CPU honours (``platforms/cpu.py``, ``v1/worker/cpu_worker.py``): with
``kv_cache_memory_bytes`` unset the worker refuses to start unless ``gpu_memory_utilization ×
total RAM`` is available, and its KV cache is that share minus the worker's RSS after loading
(``requested memory for kv (-1.65/1.35 GiB)`` when the weights exceed the share).
``VLLM_CPU_KVCACHE_SPACE`` (whole GiB) sets ``kv_cache_memory_bytes``; set, it replaces both
checks by one: ``KV ≤ available`` at allocation, and the warm-up forward is skipped under
``enforce_eager``. So :func:`engine_settings` passes ``kv_cache_memory_bytes = KV`` whenever the
default share does not hold the engine (``share × total − W − WORKER_OVERHEAD < KV``, or less than
``share × total`` is free), or when the engines at the default share do not fit the free memory
together — otherwise (the tiny models on a machine with room) the default share stays, and with it
the engines the tests share. A user's ``gpu_memory_utilization``, ``kv_cache_memory_bytes``, ``num_gpu_blocks_override``
or ``VLLM_CPU_KVCACHE_SPACE`` always wins; on a GPU nothing is derived.

:func:`plan_rows` turns these into a plan against the measured free memory (``psutil``).
"""
from __future__ import annotations

import gc
import math
import os
from dataclasses import dataclass, field

from skyrl_numerics.errors import InputError
from skyrl_numerics.host import cpu_memory_share
from .trainer_memory import copy_name, trainer_key

GiB = 1 << 30
KV_SAFETY = 1.25                  # S: blocks beyond the exact need (rounding, a preempted request)
ENGINE_OVERHEAD = int(1.25 * GiB)  # EngineCore + worker processes, beside weights and KV
WORKER_OVERHEAD = int(0.75 * GiB)  # the worker's own RSS before its weights (vLLM's share check)
HEADROOM = int(0.5 * GiB)         # kept free beside everything planned (the doctor's own arrays)
# the invariant engine and trainer hold their weights as stored (bf16), no fp32 copy (issue 26,
# item 1); raise this if a family keeps extra copies
INVARIANT_WEIGHT_FACTOR = 1.1
USER_MEMORY_KEYS = ("gpu_memory_utilization", "kv_cache_memory_bytes", "num_gpu_blocks_override")
_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8,
          "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_ds_mla": 1}
_ST_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
             "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


def gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def _pos_int(cfg: dict, key: str, default=None) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise InputError(f"config.json: {key} must be an integer >= 1, got {v!r}", field=key)
    return v


def dtype_bytes(dtype) -> int:
    d = str(dtype).replace("torch.", "")
    if d not in _BYTES:
        raise InputError(f"unsupported dtype {dtype!r} (expected one of {sorted(_BYTES)})",
                         field="dtype")
    return _BYTES[d]


# ---- the checkpoint ------------------------------------------------------------------------
def checkpoint_params(path) -> tuple[int, int]:
    """``(parameters, stored bytes)`` of a checkpoint directory, from its safetensors headers
    (checked as :func:`skyrl_numerics.doctor.model_check.inspect_checkpoint` checks them)."""
    from pathlib import Path

    from .model_check import weight_headers

    params = stored = 0
    for e in weight_headers(Path(path)).values():
        n = math.prod(e["shape"])
        params += n
        stored += e["data_offsets"][1] - e["data_offsets"][0]
    return params, stored


@dataclass(frozen=True)
class KVLayout:
    """``layers`` cache layers of ``token_bytes`` per token each, in blocks of ``block_size``."""
    kind: str          # "gqa" | "mla"
    layers: int
    token_bytes: int
    block_size: int


def is_mla(config: dict) -> bool:
    return config.get("kv_lora_rank") not in (None, 0)


def _amx() -> bool:
    try:
        import torch

        return bool(torch.cpu._is_amx_tile_supported())
    except Exception:
        return False


def kv_layout(config: dict, *, dtype: str = "bfloat16", kv_cache_dtype: str = "auto",
              batch_invariant: bool = False, kv_cache=None, amx: bool | None = None) -> KVLayout:
    """The KV cache layout vLLM CPU allocates for ``config`` (module docstring). ``dtype``: the
    engine's model dtype; ``kv_cache_dtype``: vLLM's own cache dtype (stock engine); ``kv_cache``:
    the invariant model's format (``None``/"auto", "fp8", "fp8_ds_mla", or a dict with
    ``format``)."""
    if not isinstance(config, dict):
        raise InputError("config must be a JSON object", field="config.json")
    layers = _pos_int(config, "num_hidden_layers")
    item = dtype_bytes(dtype)
    if is_mla(config):
        kind = "mla"
        width = _pos_int(config, "kv_lora_rank") + _pos_int(config, "qk_rope_head_dim")
        split = config["kv_lora_rank"]
    else:
        kind = "gqa"
        heads = _pos_int(config, "num_attention_heads")
        kv_heads = _pos_int(config, "num_key_value_heads", heads)
        hd = config.get("head_dim")
        if hd is None:
            hidden = _pos_int(config, "hidden_size")
            if hidden % heads:
                raise InputError(f"config.json: hidden_size {hidden} is not a multiple of "
                                 f"num_attention_heads {heads} (and no head_dim)", field="head_dim")
            hd = hidden // heads
        hd = _pos_int({"head_dim": hd}, "head_dim")
        width, split = 2 * kv_heads * hd, kv_heads * hd
    if batch_invariant:
        fmt = (kv_cache or {}).get("format", "auto") if isinstance(kv_cache, dict) else (kv_cache or "auto")
        if fmt == "fp8_ds_mla" and not (kind == "mla" and split == 512 and width == 576):
            raise InputError("kv_cache format 'fp8_ds_mla' needs an MLA model with kv_lora_rank "
                             "512 and qk_rope_head_dim 64", field="kv_cache.format")
        row = {"auto": width * item, "fp8": width, "fp8_ds_mla": 656}.get(fmt)
        if row is None:
            raise InputError(f"kv_cache format {fmt!r} is not auto, fp8 or fp8_ds_mla",
                             field="kv_cache.format")
        slot_heads = -(-row // (2 * 64 * item))
        # the invariant MLA model is handed to vLLM as an ordinary decoder: block size 128
        return KVLayout(kind, layers, 2 * slot_heads * 64 * item, 128)
    kv_item = item if kv_cache_dtype in (None, "auto") else dtype_bytes(kv_cache_dtype)
    amx = _amx() if amx is None else amx
    block = 16 if kind == "mla" and not amx else 128
    return KVLayout(kind, layers, width * kv_item, block)


def kv_tokens(n_prompts: int, seq_len: int, block_size: int, max_model_len: int,
              safety: float = KV_SAFETY) -> int:
    """Token slots of the cache a run of ``n_prompts`` sequences of ``seq_len`` (prompt + new
    tokens) needs (module docstring: whole blocks, at least one ``max_model_len`` request, times
    ``safety``, plus vLLM's null block)."""
    for name, v in (("prompts", n_prompts), ("seq_len", seq_len), ("block_size", block_size),
                    ("max_model_len", max_model_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(f"{name} must be an integer >= 1, got {v!r}", field=name)
    if not (isinstance(safety, (int, float)) and safety >= 1):
        raise InputError(f"safety must be a number >= 1, got {safety!r}", field="safety")
    blocks = max(n_prompts * -(-seq_len // block_size), -(-max_model_len // block_size))
    return (math.ceil(blocks * safety) + 1) * block_size


# ---- one engine ----------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineNeed:
    """What one engine holds: weights, KV cache, process overhead (bytes)."""
    weights: int
    kv: int
    overhead: int = ENGINE_OVERHEAD

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.overhead

    def describe(self) -> str:
        return (f"{gib(self.total)}: weights {gib(self.weights)}, KV {gib(self.kv)}, "
                f"overhead {gib(self.overhead)}")


def engine_need(config: dict, params: int, *, dtype: str, n_prompts: int, seq_len: int,
                max_model_len: int, batch_invariant: bool = False, kv_cache=None,
                kv_cache_dtype: str = "auto", amx: bool | None = None) -> EngineNeed:
    """:class:`EngineNeed` of one engine of this checkpoint (``params`` parameters) for a run."""
    if isinstance(params, bool) or not isinstance(params, int) or params < 1:
        raise InputError(f"params must be an integer >= 1, got {params!r}", field="params")
    lay = kv_layout(config, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                    batch_invariant=batch_invariant, kv_cache=kv_cache, amx=amx)
    tokens = kv_tokens(n_prompts, seq_len, lay.block_size, max_model_len)
    w = params * dtype_bytes(dtype)
    if batch_invariant:
        w = int(w * INVARIANT_WEIGHT_FACTOR)
    return EngineNeed(w, lay.layers * lay.token_bytes * tokens)


def user_sets_memory(engine_args: dict, env=None) -> str | None:
    """The memory knob the user set (an ``--engine-arg`` or ``VLLM_CPU_KVCACHE_SPACE``), if any."""
    env = os.environ if env is None else env
    key = next((k for k in USER_MEMORY_KEYS if k in (engine_args or {})), None)
    if key:
        return key
    return "VLLM_CPU_KVCACHE_SPACE" if env.get("VLLM_CPU_KVCACHE_SPACE") else None


def default_share_holds(need: EngineNeed, total: int, free: int,
                        share: float | None = None) -> bool:
    """Does vLLM CPU's ``gpu_memory_utilization=share`` (default: the engines' own,
    ``host.cpu_memory_share()``) hold this engine (module docstring)?"""
    share = cpu_memory_share() if share is None else share
    return share * total <= free and share * total - need.weights - WORKER_OVERHEAD >= need.kv


def engine_settings(needs: list, engine_args: dict, *, total: int, free: int,
                    on_gpu: bool = False, env=None) -> dict:
    """The ``vllm.LLM`` arguments for the run's engines: ``{"kv_cache_memory_bytes": max KV}``
    when the default share does not hold one of them, else ``{}`` (also when the user set a
    memory knob, or on a GPU)."""
    if on_gpu or not needs or user_sets_memory(engine_args, env):
        return {}
    if all(default_share_holds(n, total, free) for n in needs):
        return {}
    return {"kv_cache_memory_bytes": max(n.kv for n in needs)}


def footprint(need: EngineNeed, settings: dict, total: int, share: float | None = None) -> int:
    """Bytes an engine takes with ``settings``: its need, or at least the default share (the
    worker fills its KV cache up to ``share × total``) plus the EngineCore process."""
    share = cpu_memory_share() if share is None else share
    if settings.get("kv_cache_memory_bytes"):
        return need.total
    return max(need.total, int(share * total) + ENGINE_OVERHEAD - WORKER_OVERHEAD)


def free_memory() -> tuple[int, int]:
    """``(total, available)`` bytes of RAM (psutil)."""
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.total), int(vm.available)


# ---- the plan ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Want:
    """A row the table wants: its scenario, the engine that samples it (``engine``: a name;
    ``shared``: kept for the run), that engine's bytes, the trainer copy it loads (a name and its
    bytes) and bytes the doctor itself holds while that scenario samples (``extra``: the weights
    served in place)."""
    row: str
    scenario: str
    engine: str
    engine_bytes: int
    shared: bool
    trainer: str
    trainer_bytes: int
    extra: int = 0


@dataclass(frozen=True)
class Step:
    row: str
    mode: str          # "together" | "alone" | "skipped"
    reason: str


@dataclass
class MemoryPlan:
    free: int
    total: int
    steps: list
    settings: dict = field(default_factory=dict)      # derived engine arguments
    alone_scenarios: set = field(default_factory=set)  # engines others are released before
    trainer_one_at_a_time: bool = False                # the copies do not fit together
    release_before_scoring: bool = False
    trainer_bytes: dict = field(default_factory=dict)  # trainer copy -> bytes held + scoring
    prefetch_bytes: int = 0                            # the largest engine's footprint

    def step(self, row: str) -> Step | None:
        return next((s for s in self.steps if s.row == row), None)

    @property
    def together(self) -> bool:
        return (all(s.mode == "together" for s in self.steps) and not self.trainer_one_at_a_time
                and not self.release_before_scoring)

    def skipped(self) -> dict:
        return {s.row: s.reason for s in self.steps if s.mode == "skipped"}

    def lines(self) -> list[str]:
        head = (f"memory: {gib(self.free)} free of {gib(self.total)}"
                + (f"; engines get kv_cache_memory_bytes={self.settings['kv_cache_memory_bytes']:,}"
                   if self.settings.get("kv_cache_memory_bytes") else ""))
        if self.together:
            return [head + "; every row runs together"]
        out = [head]
        for s in self.steps:
            if s.mode != "together":
                out.append(f"  {s.row}: {s.mode}: {s.reason}")
        if self.trainer_one_at_a_time or self.release_before_scoring:
            out.append("  trainer copies: scored one at a time, each freed after its last row "
                       f"({gib(sum(self.trainer_bytes.values()))} together): "
                       + ", ".join(f"{copy_name(k)} {gib(v)}" for k, v in self.trainer_bytes.items()))
        if self.release_before_scoring:
            out.append(f"  engines closed before scoring: the largest trainer copy "
                       f"({gib(max(self.trainer_bytes.values()))} with scoring) does not fit "
                       f"beside the engines left")
        return out

    def to_dict(self) -> dict:
        return {"free_bytes": self.free, "total_bytes": self.total, "settings": self.settings,
                "trainer_one_at_a_time": self.trainer_one_at_a_time,
                "trainer_copies": {copy_name(k): v for k, v in self.trainer_bytes.items()},
                "rows": {s.row: {"mode": s.mode, "reason": s.reason} for s in self.steps}}


def plan_rows(wants: list, *, free: int | None = None, total: int | None = None,
              settings: dict | None = None) -> MemoryPlan:
    """Which ``wants`` (:class:`Want`, in table order) run together, alone or not at all,
    against ``free`` bytes (default: measured now).

    Engines start in order of first use; shared ones stay resident. An engine runs *together*
    when it fits beside the shared engines already resident (+ ``HEADROOM``), *alone* (the
    engines before it closed and the trainer copies freed first) when it fits by itself, and is
    *skipped* otherwise. Scoring runs after sampling, one trainer copy at a time (each freed after
    its last row, :func:`~skyrl_numerics.doctor.trainer_memory.scoring_order`; ``trainer_bytes``: held +
    scoring work): the engines still running are closed first when they do not fit beside the
    largest copy, and a copy that does not fit by itself skips its rows."""
    if free is None or total is None:
        t, f = free_memory()
        free, total = (f if free is None else free), (t if total is None else total)
    budget = free - HEADROOM
    steps: dict[str, Step] = {}
    engine_mode: dict[str, tuple[str, str]] = {}
    resident: dict[str, int] = {}
    alone = set()
    for w in wants:
        if w.scenario in engine_mode:
            continue
        need = w.engine_bytes + w.extra
        what = f"its engine ({w.engine}, {gib(w.engine_bytes)}" + (
            f" + {gib(w.extra)} of weights served in place" if w.extra else "") + ")"
        beside = sum(v for k, v in resident.items() if k != w.engine)
        if need > budget:
            engine_mode[w.scenario] = ("skipped", f"memory: {what} needs more than the "
                                       f"{gib(budget)} free beside {gib(HEADROOM)} headroom")
        elif beside + need <= budget:
            engine_mode[w.scenario] = ("together", f"{what} fits beside {gib(beside)} of "
                                       f"engines; {gib(budget)} free")
            if w.shared:
                resident[w.engine] = w.engine_bytes
        else:
            engine_mode[w.scenario] = ("alone", f"{what} starts after the other engines are "
                                       f"closed and the trainer copies freed ({gib(beside + need)} "
                                       f"with them > {gib(budget)} free)")
            alone.add(w.scenario)
            resident = {w.engine: w.engine_bytes} if w.shared else {}
    copies: dict[str, int] = {}
    for w in wants:
        if engine_mode[w.scenario][0] != "skipped":
            copies.setdefault(w.trainer, w.trainer_bytes)
    engines_left = sum(resident.values())
    copies = {k: v for k, v in copies.items() if v <= budget}   # the others skip their rows
    largest = max(copies.values(), default=0)
    # the copies are scored one at a time, each freed after its last row
    # (trainer_memory.scoring_order): the engines left must fit beside the largest one
    release = engines_left + largest > budget
    one_at_a_time = sum(copies.values()) > budget
    for w in wants:
        mode, why = engine_mode[w.scenario]
        if mode != "skipped" and w.trainer_bytes > budget:
            mode, why = "skipped", (f"memory: its trainer copy ({copy_name(w.trainer)}, "
                                    f"{gib(w.trainer_bytes)} with scoring) needs more than "
                                    f"{gib(budget)} free")
        steps[w.row] = Step(w.row, mode, why)
    prefetch = max((w.engine_bytes for w in wants if engine_mode[w.scenario][0] != "skipped"),
                   default=0)
    return MemoryPlan(free, total, [steps[w.row] for w in wants], dict(settings or {}), alone,
                      one_at_a_time, release, copies, prefetch)


# ---- releasing ------------------------------------------------------------------------------
def make_room(models: dict, need: int, *, keep=(), available=None, what: str = "") -> list:
    """Free trainer copies in ``models`` (oldest first, ``keep`` kept) until the measured free
    memory holds ``need`` bytes + ``HEADROOM``; returns the keys freed. ``what`` given: raise
    :class:`~skyrl_numerics.errors.NotEnoughMemory` naming it when, with every other copy
    freed, the memory still does not hold it (another process took the room the plan saw)."""
    from skyrl_numerics.errors import NotEnoughMemory

    avail = available or (lambda: free_memory()[1])
    freed = []
    for key in [k for k in models if k not in keep]:
        if avail() >= need + HEADROOM:
            break
        del models[key]
        gc.collect()
        freed.append(key)
    if what and avail() < need + HEADROOM:
        raise NotEnoughMemory(what, need + HEADROOM, avail())
    return freed


def release_engines(engines: list, models: dict | None = None) -> None:
    """Close these engines (dropped from the generator cache) and free the trainer copies in
    ``models``; returns ``None``, for the caller's references to what was freed."""
    from skyrl_numerics.engine import generator

    for eng in engines:
        if eng is None or getattr(eng, "llm", None) is None:
            continue
        for key in [k for k, v in generator._CACHE.items() if v is eng]:
            generator._CACHE.pop(key)
        eng.close()
    engines.clear()
    if models:
        models.clear()
    gc.collect()
    return None


# ---- the doctor's rows -----------------------------------------------------------------------
def plan_table(info, rows: list, engine_args: dict, *, n_prompts: int, seq_len: int,
               trainer_dtype: str | None = None, free: int | None = None,
               total: int | None = None, on_gpu: bool | None = None):
    """``(plan, wants, needs)`` for the doctor ``rows`` on checkpoint ``info``: each row's engine
    (:func:`engine_need`, the settings :func:`engine_settings` derives) and trainer copy
    (:func:`~skyrl_numerics.doctor.trainer_memory.copy_need`: the bytes of the module itself + its
    scoring work; ``trainer_dtype``: the dtype of rows keeping the stored one), planned by
    :func:`plan_rows` against ``free`` bytes (default: measured now). The CLI's up-front check
    and the doctor's plan both call this."""
    from skyrl_numerics.doctor.rows import SCENARIOS

    from .trainer_memory import copy_need

    max_model_len = engine_args.get("max_model_len", 1024)
    cfg = info.model_config
    params = info.params or checkpoint_params(info.path)[0]
    stored = info.stored_dtype if info.stored_dtype in _BYTES else "float32"
    edtype = engine_args.get("dtype", "bfloat16")
    edtype = stored if edtype in (None, "auto") else str(edtype).replace("torch.", "")
    if free is None or total is None:
        t, f = free_memory()
        free, total = (f if free is None else free), (t if total is None else total)
    if on_gpu is None:
        import torch

        on_gpu = torch.cuda.is_available()
    needs, kinds = {}, {}
    from skyrl_numerics.doctor.engines import engine_kinds

    for r in rows:
        spec = SCENARIOS[r.scenario]
        in_place, own = engine_kinds(spec)
        inv = bool(spec.engine.get("batch_invariant"))
        name = (r.scenario if own else "batch-invariant" if inv else
                "stock" + (f" ({spec.engine.get('worker_extension_cls', '').rsplit('.', 1)[-1]})"
                           if spec.engine.get("worker_extension_cls") else ""))
        kinds[r.scenario] = (name, not own, 2 * params * dtype_bytes(stored) if in_place else 0)
        if name not in needs:
            needs[name] = engine_need(cfg, params, dtype=edtype, n_prompts=n_prompts,
                                      seq_len=seq_len, max_model_len=max_model_len,
                                      batch_invariant=inv, kv_cache=spec.engine.get("kv_cache"),
                                      kv_cache_dtype=engine_args.get("kv_cache_dtype", "auto"))
    settings = engine_settings(list(needs.values()), engine_args, total=total, free=free,
                               on_gpu=on_gpu)
    copies = {}

    def planned(settings):
        wants = []
        for r in rows:
            name, shared, extra = kinds[r.scenario]
            key = trainer_key(r, trainer_dtype)
            if key not in copies:
                copies[key] = copy_need(info, key, n_prompts=n_prompts, seq_len=seq_len)
            wants.append(Want(r.name, r.scenario, name, footprint(needs[name], settings, total),
                              shared, key, copies[key], extra))
        return wants, plan_rows(wants, free=free, total=total, settings=settings)

    wants, plan = planned(settings)
    if (not settings and not plan.together and needs and not on_gpu
            and not user_sets_memory(engine_args)):
        # the default shares do not fit together: engines sized by what they need instead
        wants, plan = planned({"kv_cache_memory_bytes": max(n.kv for n in needs.values())})
    if on_gpu:   # engines share the device by gpu_memory_utilization: nothing planned there
        plan = MemoryPlan(free, total, [Step(w.row, "together", "GPU") for w in wants])
    return plan, wants, needs


def plan_for_doctor(ctx, selected: list, skipped: dict, engine_args: dict, *, prompts=None,
                    n_prompts: int, prompt_len: int, max_tokens: int,
                    progress: bool = False) -> MemoryPlan:
    """The doctor's :class:`MemoryPlan`: the trainer copies loaded so far are freed, the free
    memory measured, the rows that apply (``skipped[name] is None``) planned by
    :func:`plan_table` for ``prompts`` (else ``n_prompts`` of ``prompt_len``) + ``max_tokens``.
    Rows that do not fit get their reason in ``skipped``; the plan is logged, printed when a
    row does not run together (or with ``progress``) unless the CLI's check printed the same
    lines already, and kept on ``ctx.memory`` and ``ctx.info.memory_plan``."""
    import logging

    if prompts:
        n_prompts, prompt_len = len(prompts), max(map(len, prompts))
    ctx._models.clear()
    gc.collect()
    info = ctx.info
    rows = [r for r in selected if skipped.get(r.name) is None]
    from skyrl_numerics.doctor.rows import longest_sequence

    plan, wants, needs = plan_table(info, rows, engine_args, n_prompts=n_prompts,
                                    seq_len=longest_sequence(rows, prompt_len, max_tokens),
                                    trainer_dtype=ctx.dtype)
    printed = getattr(info, "memory_lines", None)
    ctx.memory = plan
    info.memory_plan = plan
    skipped.update({r: why for r, why in plan.skipped().items() if skipped.get(r) is None})
    lines = plan.lines()
    log = logging.getLogger("skyrl_numerics.doctor")
    for w in wants:
        log.info("memory: %s: engine %s %s; trainer %s %s", w.row, w.engine,
                 needs[w.engine].describe(), copy_name(w.trainer), gib(w.trainer_bytes))
    for line in lines:
        log.info("%s", line)
    if (progress or not plan.together or plan.settings) and _rows_of(lines) != _rows_of(printed):
        import rich

        for line in lines:
            rich.get_console().print(line, markup=False, highlight=False, soft_wrap=True)
    return plan


def announce_plan(info, rows: list, engine_args: dict, *, n_prompts: int, seq_len: int,
                  trainer_dtype: str | None = None) -> MemoryPlan:
    """The CLI's up-front look at the whole table (before any engine starts or weight is read):
    :func:`plan_table` for ``rows`` (those the doctor will skip by what the config, weight
    names and host tell left out: :func:`~skyrl_numerics.doctor.skip_reason` without loading
    the model), its lines printed when a row does not run together —
    one line a row, saying alone or skipped and why — and kept on ``info.memory_lines`` so the
    doctor's own plan is printed again only when it differs."""
    from skyrl_numerics.doctor import DoctorContext, skip_reason

    ctx = DoctorContext(model_dir=info.path, family=info.model_type, info=info,
                        dtype=trainer_dtype)
    rows = [r for r in rows if skip_reason(r, ctx, load=False) is None]
    plan = plan_table(info, rows, engine_args, n_prompts=n_prompts, seq_len=seq_len,
                      trainer_dtype=trainer_dtype)[0]
    info.memory_lines = plan.lines()
    if not plan.together or plan.settings:
        import rich

        for line in info.memory_lines:
            rich.get_console().print(line, markup=False, highlight=False, soft_wrap=True)
    return plan


def _rows_of(lines) -> list | None:
    """The plan's lines without the measured free memory (the head), to compare two plans."""
    return [ln for ln in lines if ln.startswith("  ")] if lines else None


def make_room_for(ctx, key) -> list:
    """Before ``ctx`` loads the trainer copy ``key``: free older copies until the measured free
    memory holds it (its bytes from the plan, with its load and scoring) + ``HEADROOM``; with
    room, nothing is freed; without, even with the others freed,
    :class:`~skyrl_numerics.errors.NotEnoughMemory` (the row is skipped, nothing crashes)."""
    plan = getattr(ctx, "memory", None)
    if plan is None or key in ctx._models:
        return []
    return make_room(ctx._models, plan.trainer_bytes.get(key, 0), keep=(key,),
                     what=f"its trainer copy ({copy_name(key)}, with scoring)")


def scoring_needs_the_engines_memory(plan, available=None) -> bool:
    """Close the engines before scoring? Planned so, or the free memory measured now does not
    hold the largest trainer copy (+ ``HEADROOM``): other processes may have taken the room the
    plan saw."""
    if plan is None or not plan.trainer_bytes:
        return False
    if plan.release_before_scoring:
        return True
    avail = free_memory()[1] if available is None else available
    return avail < max(plan.trainer_bytes.values()) + HEADROOM
