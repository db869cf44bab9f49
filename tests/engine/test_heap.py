"""engine/heap.py: glibc accepts the two thresholds (this machine's C library is glibc),
once per process, and the variable turns it off."""
import platform

import pytest

from skyrl_numerics.engine import heap


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_keep_heap_sets_the_thresholds_once(monkeypatch):
    monkeypatch.setattr(heap, "_DONE", None)
    assert heap.keep_heap() is True
    monkeypatch.setattr(heap, "MMAP_THRESHOLD", -5)       # a second call does not call again
    assert heap.keep_heap() is True


def test_keep_heap_off(monkeypatch):
    monkeypatch.setattr(heap, "_DONE", None)
    monkeypatch.setenv("SKYRL_NUMERICS_KEEP_HEAP", "0")
    assert heap.keep_heap() is False
