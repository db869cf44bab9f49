"""The execution contract: one fingerprint of everything that decides a forward's bits.

Bitwise trainer = engine holds only when both sides run the same numbers: the same family and
config, the same serving numerics (formats per linear group, LoRA), the same KV-cache format, the
same dtype, the same kernels (the mode's op table, the compiled C kernels) on the same ISA, under
the same torch and vLLM. An :class:`ExecutionContract` names each of those as one field::

    field         what it holds                                         computed from
    forward       "invariant" | "hf" | "vllm"  (which forward runs)     the side itself
    family        the HF architecture                                   the model / its config
    config        digest of the family's dims and RoPE (invariant) or   model.dims, model.rope
                  of the HF config (hf, vllm)                           (tensors by their bytes)
    dtype         the model dtype                                       model.dtype
    numerics      the plan's formats per group, JSON ("none")           model.numerics
    lora          rank, alpha, targets, seed of the plan's adapters     model.numerics
    kv_format     the KV-cache spec (format, k_scale, v_scale), JSON    model.kv.spec
    mode_ops      digest of kernels.mode.op_table (op -> kernel)        kernels/mode.py
    kernel_build  digest of the compiled C kernels (sources, library,   kernels/native.py,
                  binary) and the kernels package's Python sources,     kernels/*.py,
                  plus " gemm_bf16=amx" where the bf16 GEMMs run on     SKYRL_NUMERICS_GEMM
                  AMX tiles (kernels/cpu_gemm_amx.py)
    isa           host ISA, torch's CPU capability, ISA caps            host.host_info
                  (GPU: device name and compute capability)
    torch         torch.__version__
    vllm          host.vllm_version() (None: not installed)

``fingerprint()`` is the sha256 (32 hex digits) of the canonical JSON of the fields (sorted keys,
no spaces); :meth:`ExecutionContract.diff` lists ``(field, ours, theirs)`` for every field that
differs, and :func:`check` raises :class:`~skyrl_numerics.errors.ContractMismatch` naming them.

The trainer computes its side from the model it runs (:func:`of_model`; an HF trainer from its
config: :func:`of_hf`); the engine computes its side *inside its worker* from the model the
worker runs (``engine/vllm_ext.py``: ``skyrl_contract``), reached with ``collective_rpc`` by
``VLLMGenerator.contract()`` and over ``GET /skyrl_contract`` by ``RemoteGenerator.contract()``.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from skyrl_numerics.errors import ContractMismatch, InputError
from skyrl_numerics.hashing import json_key
from skyrl_numerics.host import host_info, vllm_version
from skyrl_numerics.kernels import cpu_gemm_amx, native
from skyrl_numerics.kernels.mode import op_table

from . import FAMILIES
from .kv_format import parse_kv_spec
from .numerics import NumericsPlan

__all__ = ["ExecutionContract", "of_model", "of_hf", "check", "canonical", "process_fields"]

FORWARDS = ("invariant", "hf", "vllm")
KERNELS_DIR = Path(native.__file__).parent
# HF config keys that name the file, not the numbers (the engine's overrides add skyrl_* keys)
_CONFIG_SKIP = ("_name_or_path", "transformers_version", "architectures", "torch_dtype", "dtype",
                "model_type", "auto_map")


@dataclass(frozen=True)
class ExecutionContract:
    """What decides the bits of one side's forward (module docstring: each field)."""
    forward: str
    family: str
    config: str
    dtype: str
    numerics: str
    lora: str
    kv_format: str
    mode_ops: str
    kernel_build: str
    isa: str
    torch: str
    vllm: str | None

    def __post_init__(self):
        if self.forward not in FORWARDS:
            raise InputError(f"forward {self.forward!r} is not one of {FORWARDS}", field="forward")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not (isinstance(v, str) or (v is None and f.name == "vllm")):
                raise InputError(f"expected a string, got {type(v).__name__}", field=f.name)

    def canonical(self) -> str:
        """The fields as canonical JSON: sorted keys, no spaces."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))

    def fingerprint(self) -> str:
        """sha256 of :meth:`canonical`, 32 hex digits."""
        return hashlib.sha256(self.canonical().encode()).hexdigest()[:32]

    def diff(self, other: "ExecutionContract") -> list[tuple[str, object, object]]:
        """``(field, ours, theirs)`` for every field that differs, in field order."""
        return [(f.name, getattr(self, f.name), getattr(other, f.name))
                for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)]

    def to_dict(self) -> dict:
        """The fields and the fingerprint (what ``train.json`` / ``report.json`` record and the
        engine answers)."""
        return {**dataclasses.asdict(self), "fingerprint": self.fingerprint()}

    @classmethod
    def from_dict(cls, d: dict, *, source: str | None = None) -> "ExecutionContract":
        """Back from :meth:`to_dict` (an engine's answer); a missing field, or a fingerprint
        that is not the fields', is an InputError naming it."""
        if not isinstance(d, dict):
            raise InputError(f"an execution contract is a JSON object, got {type(d).__name__}",
                             field="contract", source=source)
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in d]
        if missing:
            raise InputError(f"the execution contract lacks {missing}", field=missing[0], source=source)
        try:
            out = cls(**{n: d[n] for n in names})
        except InputError as e:
            raise e.with_source(source) if source else e
        if "fingerprint" in d and d["fingerprint"] != out.fingerprint():
            raise InputError(f"fingerprint {d['fingerprint']!r} is not its fields' "
                             f"({out.fingerprint()})", field="fingerprint", source=source)
        return out


def check(trainer: ExecutionContract, engine: ExecutionContract, *, what: str = "") -> None:
    """Raise :class:`ContractMismatch` naming every field where ``engine`` differs from
    ``trainer`` (``what``: where the check ran, e.g. ``"config 'bitwise', sync 3"``)."""
    d = trainer.diff(engine)
    if d:
        raise ContractMismatch(d, what=what)


# ---- the fields -------------------------------------------------------------------------------
def canonical(obj):
    """A JSON-able value of ``obj``: dataclasses by field, tensors by dtype, shape and a sha256 of
    their bytes, floats exactly (``float.hex``), other objects by ``str``."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: canonical(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, torch.Tensor):
        t = obj.detach().contiguous().cpu()
        return {"dtype": str(t.dtype), "shape": list(t.shape),
                "sha256": hashlib.sha256(t.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:32]}
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        return obj.hex()
    if isinstance(obj, dict):
        return {str(k): canonical(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, (list, tuple)):
        return [canonical(v) for v in obj]
    return str(obj)


def _plan_fields(plan: NumericsPlan | None) -> tuple[str, str]:
    """(``numerics``, ``lora``) of a plan: its formats as JSON, its adapters as JSON (each
    ``"none"`` when the plan has none: a LoRA-only plan differs from no plan in ``lora`` alone)."""
    if plan is None:
        return "none", "none"
    d = json.loads(plan.to_json())
    formats = json.dumps(d["formats"], sort_keys=True, separators=(",", ":")) if d["formats"] else "none"
    if not plan.lora:
        return formats, "none"
    lora = {"rank": plan.lora_rank, "alpha": plan.lora_alpha, "targets": list(plan.lora_targets),
            "seed": plan.seed}
    return formats, json.dumps(lora, sort_keys=True, separators=(",", ":"))


def kv_field(spec) -> str:
    """A KV spec (``parse_kv_spec`` input) as canonical JSON."""
    return json.dumps(parse_kv_spec(spec), sort_keys=True, separators=(",", ":"))


def _python_kernel_sources() -> str:
    h = hashlib.sha256()
    for p in sorted(KERNELS_DIR.glob("*.py")):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def _isa() -> str:
    if torch.cuda.is_available():
        i = torch.cuda.current_device()
        cap = torch.cuda.get_device_capability(i)
        return f"cuda {torch.cuda.get_device_name(i)} sm_{cap[0]}{cap[1]}"
    h = host_info()
    caps = ",".join(f"{k}={v}" for k, v in sorted(h["isa_caps"].items()))
    return f"{h['isa']}; torch {h['torch_cpu_capability']}" + (f"; caps {caps}" if caps else "")


@functools.lru_cache(maxsize=1)
def _static_fields() -> tuple[dict, dict]:
    """What :func:`process_fields` computes once: the fields, and the kernel build's parts."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return ({"mode_ops": json_key(op_table(device)), "isa": _isa(), "torch": str(torch.__version__),
             "vllm": vllm_version()},
            {"native": native.build_digest(), "python": _python_kernel_sources()})


def process_fields() -> dict:
    """The fields every model of this process shares: ``mode_ops``, ``kernel_build`` (with the
    bf16 GEMM arithmetic, ``SKYRL_NUMERICS_GEMM``, read now), ``isa``, ``torch``, ``vllm``."""
    fields, build = _static_fields()
    gemm = cpu_gemm_amx.arithmetic()
    # the default arithmetic leaves the field as it was before there were two; another is named
    return {**fields, "kernel_build": json_key(build) + ("" if gemm == "fma" else f" gemm_bf16={gemm}")}


def family_of(model) -> str:
    """The HF architecture an invariant model's class is registered for."""
    path = f"{type(model).__module__}:{type(model).__name__}"
    for arch, (_, where) in FAMILIES.items():
        if where == path:
            return arch
    raise InputError(f"{type(model).__name__} is not a registered invariant family", field="family")


def of_model(model) -> ExecutionContract:
    """The contract of an invariant model (:class:`~.base.InvariantCausalLM`) — the trainer's,
    or the one a vLLM worker runs (``engine/vllm_ext.py``)."""
    numerics, lora = _plan_fields(model.numerics)
    config = {"dims": canonical(model.dims), "rope": canonical(getattr(model, "rope", None))}
    if getattr(model, "index", None) is not None:      # DSA's indexer (deepseek_v32)
        config["index"] = canonical(model.index)
    return ExecutionContract(
        forward="invariant", family=family_of(model), config=json_key(config),
        dtype=str(model.dtype).removeprefix("torch."), numerics=numerics, lora=lora,
        kv_format=kv_field(model.kv.spec), **process_fields())


def hf_config_digest(config: dict) -> str:
    """Digest of an HF config dict without the keys that name the file rather than the numbers
    (:data:`_CONFIG_SKIP`) and the engine's ``skyrl_*`` overrides."""
    kept = {k: v for k, v in config.items() if k not in _CONFIG_SKIP and not k.startswith("skyrl_")}
    return json_key(canonical(kept))


def of_hf(config: dict, *, forward: str = "hf", dtype, numerics=None, kv_cache=None,
          kv_format: str | None = None, mode: bool = False,
          kernel_build: str | None = None) -> ExecutionContract:
    """The contract of a forward that is not the invariant one: an HF trainer (``forward="hf"``,
    ``mode``: under ``batch_invariant_mode``) or a stock vLLM worker (``forward="vllm"``,
    ``kernel_build``: its kernel library, ``kv_format``: vLLM's ``cache_dtype`` as it is).
    ``config``: the HF config as a dict. Recorded beside
    the engine's; only a bitwise run refuses a difference."""
    archs = config.get("skyrl_base_arch") or (config.get("architectures") or ["?"])[0]
    plan = NumericsPlan.from_json(numerics)
    nf, lora = _plan_fields(plan)
    proc = process_fields()
    return ExecutionContract(
        forward=forward, family=str(archs), config=hf_config_digest(config),
        dtype=str(dtype).removeprefix("torch."), numerics=nf, lora=lora,
        kv_format=kv_format or kv_field(kv_cache), mode_ops=proc["mode_ops"] if mode else "off",
        kernel_build=kernel_build or (proc["kernel_build"] if mode else "torch"),
        isa=proc["isa"], torch=proc["torch"], vllm=proc["vllm"])
