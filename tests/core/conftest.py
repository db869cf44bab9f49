"""Shared fixtures of the core tests."""
from __future__ import annotations

import pytest


@pytest.fixture
def fake_engines(monkeypatch):
    """``install(make)``: the doctor's engines become ``make(model_dir, **kw)`` stand-ins —
    ``VLLMGenerator`` is ``make``, ``get_generator`` caches one per argument set as the real one
    does."""
    from skyrl_numerics.trainer.engine import generator

    def install(make):
        cache = {}

        def get(model_dir, **kw):
            key = tuple(sorted(kw.items()))
            if key not in cache:
                cache[key] = make(model_dir, **kw)
            return cache[key]

        monkeypatch.setattr(generator, "get_generator", get)
        monkeypatch.setattr(generator, "VLLMGenerator", make)
    return install
