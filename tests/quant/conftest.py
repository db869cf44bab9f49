"""Quant tests. The Triton fake-quant tests that run kernels (``triton``-marked and not ``slow``:
test_triton.py; the slow compile test strips the variable itself) run in a child pytest with
``TRITON_INTERPRET=1`` set there only (``tests/triton_child.py`` says why); this conftest never
sets it, so it cannot leak into later tests or the processes they start (vLLM workers)."""
import pytest

import triton_child


def pytest_configure(config):
    config.addinivalue_line("markers", triton_child.MARKER)


def _wanted(item) -> bool:
    here = __file__.rsplit("/", 1)[0]
    if not str(item.path).startswith(here + "/"):
        return False
    if item.get_closest_marker("interpreter") is not None:
        return True
    return item.get_closest_marker("triton") is not None and item.get_closest_marker("slow") is None


@pytest.hookimpl(trylast=True)   # after -k / -m deselection: the child runs only what is selected
def pytest_collection_modifyitems(config, items):
    triton_child.redirect(items, _wanted)
