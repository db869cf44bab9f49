"""Where skyrl-numerics keeps what it builds once and reuses: the compiled CPU kernels, the tiny
checkpoints, the host's vLLM kernel probes.

One folder: ``SKYRL_NUMERICS_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/skyrl_numerics``, else
``~/.cache/skyrl_numerics``. ``SKYRL_NUMERICS_CACHE`` is the old name, read when the new one is
not set.
"""
from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "SKYRL_NUMERICS_CACHE_DIR"
OLD_CACHE_ENV = "SKYRL_NUMERICS_CACHE"     # deprecated alias of CACHE_ENV


def cache_dir(sub: str | None = None) -> Path:
    """The cache folder (see the module docstring), or its subfolder ``sub``. Not created."""
    root = os.environ.get(CACHE_ENV) or os.environ.get(OLD_CACHE_ENV)
    if root:
        base = Path(root)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = Path(xdg) / "skyrl_numerics"
    return base / sub if sub else base
