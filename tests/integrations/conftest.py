"""The RL frameworks' own released code, for the tests in this folder only.

``make venv`` installs ``skyrl==0.4.0`` and ``trl==1.16.0`` test-only, ``--no-deps``, into folders
beside the venv's site-packages (Makefile): ``<venv>/frameworks/skyrl`` and ``<venv>/frameworks/trl``.
Nothing in the venv changes, and no test outside this folder sees them:

- ``skyrl`` (fixture, module scope): puts ``frameworks/skyrl`` on ``sys.path`` and sets
  ``typing.TypedDict = typing_extensions.TypedDict`` while the module's tests run (skyrl's package
  import defines pydantic models over TypedDicts, and pydantic refuses the stdlib one below Python
  3.12), then takes both back. It returns ``skyrl(name)``, which imports ``skyrl.<name>``. What it
  imported stays in ``sys.modules``: skyrl and its small deps, which nothing outside this folder
  imports.
- ``trl_env`` (fixture): TRL's imports pull accelerate, datasets, pandas and pyarrow, which would
  change what transformers finds in this process, so TRL runs only in child processes; this is
  their environment (``frameworks/trl`` on ``PYTHONPATH``).

Where a folder is missing (a run without ``make venv``), the tests that need it skip with a reason
naming the folder and the command that installs it (``-ra`` prints it in the summary).
"""
from __future__ import annotations

import importlib
import os
import sys
import typing

import pytest
import typing_extensions

from framework_paths import framework_dir


@pytest.fixture(scope="module")
def skyrl():
    """``skyrl(name) -> module skyrl.<name>``, imported from ``frameworks/skyrl`` (module doc)."""
    folder = str(framework_dir("skyrl"))
    saved = typing.TypedDict
    sys.path.insert(0, folder)
    typing.TypedDict = typing_extensions.TypedDict
    try:
        yield lambda name: importlib.import_module(f"skyrl.{name}")
    finally:
        typing.TypedDict = saved
        sys.path.remove(folder)


@pytest.fixture
def trl_env() -> dict:
    """The environment of a child process that imports ``trl`` from ``frameworks/trl``."""
    folder = str(framework_dir("trl"))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (folder, env.get("PYTHONPATH")) if p)
    return env


SKYRL_API_KEY = "skyrl-serve-test-key"


@pytest.fixture(scope="module")
def skyrl_server(qwen_moe_dir, tmp_path_factory):
    """One ``skyrl-numerics serve``-equivalent server (``VLLMServer``: our plugin, routes captured,
    ``--enable-scale-out``) on the tiny Qwen3-MoE, batch-invariant and keyed with
    :data:`SKYRL_API_KEY`, for SkyRL's own clients (``test_skyrl_serve.py``)."""
    from skyrl_numerics.engine.server import VLLMServer

    log = tmp_path_factory.mktemp("skyrl_serve") / "vllm.log"
    with VLLMServer(qwen_moe_dir, api_key=SKYRL_API_KEY, batch_invariant=True, log_path=log) as srv:
        yield srv
