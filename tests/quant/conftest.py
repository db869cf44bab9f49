"""Quant tests. Tests marked ``interpreter`` (test_triton.py's fake-quant kernels; its slow
compile test is not marked and removes the variable itself) run in a child pytest with
``TRITON_INTERPRET=1`` set there only (``tests/triton_child.py`` says why); this conftest never
sets it, so it cannot leak into later tests or the processes they start (vLLM workers)."""
import pytest

import triton_child


def pytest_configure(config):
    config.addinivalue_line("markers", triton_child.MARKER)


@pytest.hookimpl(trylast=True)   # after -k / -m deselection: the child runs only what is selected
def pytest_collection_modifyitems(config, items):
    triton_child.redirect_marked(items, __file__)
