"""Shared fixtures: tiny checkpoints (built once, cached by config hash) and one vLLM engine per session."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Keep built checkpoints inside the repo's ignored .cache/ unless the user chose a place.
os.environ.setdefault("SKYRL_NUMERICS_CACHE", str(REPO / ".cache"))


@pytest.fixture(scope="session")
def qwen_moe_dir() -> Path:
    from skyrl_numerics.models import build_tiny_model

    return build_tiny_model("qwen3_moe")


@pytest.fixture(scope="session")
def deepseek_v3_dir() -> Path:
    from skyrl_numerics.models import build_tiny_model

    return build_tiny_model("deepseek_v3")


@pytest.fixture(scope="session")
def vllm_qwen(qwen_moe_dir):
    """The real vLLM CPU engine on the tiny Qwen3-MoE; start-up (~30 s) paid once per session."""
    pytest.importorskip("vllm")
    from skyrl_numerics.trainer import get_generator

    gen = get_generator(qwen_moe_dir)
    yield gen
    gen.close()
