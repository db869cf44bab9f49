"""The compiled CPU kernels (``kernels/csrc/*.c``): built once per machine with the system C
compiler, loaded with ctypes.

One shared library holds every kernel of ``csrc/``. It is compiled on first use into a cache
folder — ``SKYRL_NUMERICS_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/skyrl_numerics`` or
``~/.cache/skyrl_numerics`` — under a name that hashes the sources, the flags, the compiler's
version and the machine, so an edit or another compiler builds a new file; the build goes to a
temporary file that is renamed into place (processes that build at the same time each rename a
complete library). ``make`` builds it ahead (``python -m skyrl_numerics.kernels.native``).

Flags: ``-O3 -march=native -ffp-contract=off -fno-fast-math``: every float operation is the
IEEE binary32 operation the source writes, rounded on its own (no fused multiply-add, no
reassociation), so the results do not depend on the compiler, its vector width or the CPU
(a baseline ``-O2`` build gives the same bits: tested), and each kernel's torch specification
reproduces them bit for bit (tested). ``-march=native`` only picks the vector instructions
(``SKYRL_NUMERICS_NATIVE_MARCH`` picks another, e.g. ``x86-64-v3`` to run an AVX2 host's build).
The one exception is opt-in: the AMX arithmetic of the bf16 GEMM (``cpu_gemm_amx``), built only
where ``-march`` targets AMX.

``SKYRL_NUMERICS_NATIVE=0`` never builds or loads it (the torch specifications run instead:
the same bits, slower); ``=1`` makes a failed build an error instead of a fallback. ``CC``
picks the compiler (default ``cc``).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from skyrl_numerics import paths

CSRC = Path(__file__).with_name("csrc")
BASE_FLAGS = ("-O2", "-std=c11", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared")
FLAGS = ("-O3", "-march=native") + BASE_FLAGS[1:]
MARCH_ENV = "SKYRL_NUMERICS_NATIVE_MARCH"   # another -march than native (e.g. x86-64-v3: AVX2)

_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_TRIED = False
_ERROR: str | None = None


class NativeBuildError(RuntimeError):
    """The compiled kernels could not be built or loaded (and ``SKYRL_NUMERICS_NATIVE=1``)."""


def _mode() -> str:
    v = os.environ.get("SKYRL_NUMERICS_NATIVE", "auto").strip().lower()
    return {"0": "off", "false": "off", "no": "off", "1": "on", "true": "on", "yes": "on"}.get(v, "auto")


def cache_dir() -> Path:
    return paths.cache_dir()


def host_flags() -> tuple[str, ...]:
    """The flags of this process's build: :data:`FLAGS`, with ``-march`` from
    ``SKYRL_NUMERICS_NATIVE_MARCH`` when set (to run what another CPU's build runs, e.g.
    ``x86-64-v3`` for an AVX2 + FMA host: the same bits, tested, other speed)."""
    march = os.environ.get(MARCH_ENV, "").strip()
    if not march:
        return FLAGS
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", march):
        raise NativeBuildError(f"{MARCH_ENV}={march!r}: expected a -march name such as x86-64-v3")
    return ("-O3", f"-march={march}") + BASE_FLAGS[1:]


def _compiler() -> str:
    return os.environ.get("CC") or "cc"


def _cpu_id() -> str:
    """The CPU's feature flags (``-march=native`` builds for them: another CPU sharing the
    cache folder gets its own build)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _sources() -> list[Path]:
    return sorted(CSRC.glob("*.c"))


def _headers() -> list[Path]:
    return sorted(CSRC.glob("*.h"))


def library_path(flags=None) -> Path:
    """Where the library built with ``flags`` (default :func:`host_flags`) lives (whether or not
    it exists yet)."""
    flags = host_flags() if flags is None else flags
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = "missing"
    h = hashlib.sha256()
    for part in (cc, version, " ".join(flags), platform.machine(), sys.platform, _cpu_id()):
        h.update(part.encode() + b"\0")
    for src in _sources() + _headers():
        h.update(src.name.encode() + b"\0" + src.read_bytes())
    return cache_dir() / f"skyrl_kernels-{h.hexdigest()[:16]}.so"


def build(flags=None) -> Path:
    """Compile the library if it is not in the cache yet; its path. Without ``flags``:
    :func:`host_flags`, or :data:`BASE_FLAGS` when the compiler refuses them. Raises
    NativeBuildError."""
    if flags is None:
        errors = []
        for fs in (host_flags(), BASE_FLAGS):
            try:
                return build(fs)
            except NativeBuildError as e:
                errors.append(str(e))
        raise NativeBuildError("; ".join(dict.fromkeys(errors)))
    path = library_path(flags)
    if path.exists():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp.so", dir=path.parent)
        os.close(fd)
    except OSError as e:
        raise NativeBuildError(f"cache folder {path.parent}: {e}") from None
    cmd = [_compiler(), *flags, "-I", str(CSRC), "-o", tmp, *map(str, _sources()), "-lm"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        os.unlink(tmp)
        raise NativeBuildError(f"{' '.join(cmd[:1])}: {e}") from None
    if r.returncode != 0:
        os.unlink(tmp)
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise NativeBuildError(f"{cmd[0]} exited {r.returncode}: {last}")
    os.replace(tmp, path)
    return path


def load(path) -> ctypes.CDLL:
    """A built library loaded with its functions' signatures declared."""
    loaded = ctypes.CDLL(str(path))
    _declare(loaded)
    return loaded


_I64, _I32, _F32, _PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
SIGNATURES = {   # every kernel returns an int status (0: done)
    "skyrl_attention_fwd": ([_PTR, _I32, _I64, _I64, _I64] * 3 + [_PTR, _I64, _I64, _PTR, _I32, _PTR]
                            + [_I32] * 7 + [_F32, _I32, _I64, _I64, _PTR, _I64]),
    "skyrl_rms_norm_fwd": [_PTR, _I32, _I64, _PTR, _I32, _I64, _PTR, _I32, _PTR, _I64, _I64, _I32, _F32],
    "skyrl_add_rms_norm": [_PTR, _I64, _PTR, _I64, _PTR, _I32, _PTR, _PTR, _I64, _I64, _I32, _F32],
    "skyrl_moe_sort": [_PTR, _I64, _I32, _I64, _PTR, _PTR, _PTR, _PTR],
    "skyrl_moe_combine": [_PTR, _I64, _I64, _I32, _PTR, _PTR, _I64, _I32, _PTR],
    "skyrl_row_sum": [_PTR, _I64, _I64, _PTR, _I64, _I64],
    "skyrl_gemm_bf16": [_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64],
    "skyrl_gemm_bf16_io": [_PTR, _I32, _I64, _PTR, _I64, _PTR, _I32, _I64, _I64, _I64, _I64, _I64],
    "skyrl_gemm_bf16_grouped": [_PTR, _I32, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I32, _I64, _I64, _I64,
                                _I64],
    "skyrl_amx_available": [],
    "skyrl_amx_pack_x": [_PTR, _I64, _I64, _I64, _PTR],
    "skyrl_gemm_bf16_amx": [_PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64],
    "skyrl_amx_pack_grouped": [_PTR, _I64, _PTR, _I64, _I64, _PTR],
    "skyrl_gemm_bf16_amx_grouped": [_PTR, _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64],
    "skyrl_qkv_norm_rope": [_PTR, _I64, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR,
                            _I32, _I32, _PTR, _PTR, _PTR, _PTR, _I32, _F32, _I32, _PTR, _PTR, _I64,
                            _I64],
    "skyrl_qk_norm_rope": [_PTR, _I64, _I32, _PTR, _I64, _I32, _PTR, _PTR, _PTR, _PTR, _I32, _F32, _I32,
                           _PTR, _PTR, _I64, _I64, _I64],
}


def _declare(lib: ctypes.CDLL) -> None:
    for name, args in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = _I32, args


def lib() -> ctypes.CDLL | None:
    """The loaded library, or None when it is off or could not be built (the reason:
    :func:`unavailable_reason`)."""
    global _LIB, _TRIED, _ERROR
    if _LIB is not None or (_TRIED and _mode() != "on"):
        return _LIB
    mode = _mode()
    if mode == "off":
        return None
    with _LOCK:
        if _LIB is None and not (_TRIED and mode != "on"):
            _TRIED = True
            try:
                _LIB, _ERROR = load(build()), None
            except (NativeBuildError, OSError, AttributeError) as e:
                _ERROR = str(e)
                if mode == "on":
                    raise NativeBuildError(f"compiled kernels unavailable: {e}") from None
    return _LIB


def unavailable_reason() -> str | None:
    return None if _LIB is not None else (_ERROR or ("off (SKYRL_NUMERICS_NATIVE=0)"
                                                    if _mode() == "off" else None))


def build_digest() -> dict:
    """What this process's compiled kernels are, for the execution contract
    (``invariant/contract.py``): ``state`` ("loaded", "off" or "unavailable: why"), the
    ``sources`` digest (sha256 of every ``csrc`` file's name and bytes, 16 hex digits) and, when
    loaded, the ``library`` file name (it hashes compiler, flags and CPU) and the ``binary``
    digest of its bytes. Loads the library as the forward would (:func:`lib`); a library
    already loaded is reported as loaded (the kernels keep calling it)."""
    h = hashlib.sha256()
    for src in _sources() + _headers():
        h.update(src.name.encode() + b"\0" + src.read_bytes())
    out = {"sources": h.hexdigest()[:16]}
    loaded = lib()     # once loaded, the forward keeps using it whatever the environment says
    if loaded is None:
        out["state"] = "off" if _mode() == "off" else f"unavailable: {unavailable_reason()}"
        return out
    path = Path(loaded._name)
    out.update(state="loaded", library=path.name,
               binary=hashlib.sha256(path.read_bytes()).hexdigest()[:16])
    return out


if __name__ == "__main__":
    print(build())
