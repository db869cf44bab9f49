"""Where ``make venv`` puts the frameworks' released code (Makefile; tests/integrations/conftest.py,
and the TRL child of tests/kernels/test_mode_trace.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

FRAMEWORKS = Path(sys.prefix) / "frameworks"
#: the releases the tests pin (the Makefile installs exactly these)
PINS = {"skyrl": "0.4.0", "trl": "1.16.0"}


def framework_dir(name: str, root: Path = FRAMEWORKS) -> Path:
    """``<root>/<name>`` holding the pinned release, or skip naming the folder and what is wrong."""
    folder = root / name
    if (folder / f"{name}-{PINS[name]}.dist-info").is_dir():
        return folder
    found = sorted(p.name for p in folder.glob(f"{name}-*.dist-info")) if folder.is_dir() else []
    what = ("it is missing" if not folder.is_dir() else
            f"it holds {', '.join(found)}" if found else f"it holds no {name} release")
    pytest.skip(f"test-only {name}=={PINS[name]} is not installed in {folder} ({what}): "
                f"run `make venv`, which installs it there with --no-deps")
