"""Run the tests that need the Triton interpreter in a child pytest, with ``TRITON_INTERPRET=1``
in the child's environment only.

Why a child process: the interpreter is chosen when Triton is *imported* (``triton.language``'s
own ``@jit`` helpers such as ``tl.cdiv`` are decorated then), not per call; a variable set by a
conftest before that import leaks into every later test and into every process the tests start
(vLLM workers), and one set later is too late once anything (vLLM, the mode's CUDA table) has
imported Triton. So the parent never sets it: ``redirect(items, wanted)`` replaces the ``runtest``
of the wanted items by a lookup into one child run per test file (``--junitxml``), and each item
passes, fails (with the child's message) or skips as it did in the child.

Every test marked ``interpreter`` under tests/kernels/ or tests/quant/ runs this way: their
conftests call ``redirect_marked(items, __file__)`` from ``pytest_collection_modifyitems`` (the one
child-process mechanism for interpreter tests; tests that compile for a GPU target instead run a
child with ``TRITON_INTERPRET`` removed, since the interpreter must be off there).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

CHILD = "SKYRL_NUMERICS_INTERPRETER_CHILD"
MARKER = "interpreter: runs Triton kernels on CPU tensors; executed in a child pytest with TRITON_INTERPRET=1"
_RESULTS: dict[str, dict[str, tuple[str, str]]] = {}


def in_child() -> bool:
    return os.environ.get(CHILD) == "1"


def _run_file(path: Path, names: list[str], rootdir: Path, tmp: Path) -> dict[str, tuple[str, str]]:
    xml = tmp / f"{path.stem}.xml"
    env = {**os.environ, "TRITON_INTERPRET": "1", CHILD: "1"}
    ids = [f"{path}::{n}" for n in names]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
                           str(rootdir), f"--junitxml={xml}", *ids], env=env, cwd=str(rootdir),
                          capture_output=True, text=True, timeout=1800)
    if not xml.exists():
        raise RuntimeError(f"child pytest wrote no report (rc {proc.returncode}):\n{proc.stdout[-3000:]}"
                           f"\n{proc.stderr[-3000:]}")
    out = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        res = ("passed", "")
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                res = (tag, (el.get("message") or "") + "\n" + (el.text or ""))
                break
        prev = out.get(case.get("name"))
        if prev is None or prev[0] == "passed":       # a setup error and a call both reported
            out[case.get("name")] = res
    return out


def _child_runtest(item, names: list[str]) -> None:
    key = str(item.path)
    if key not in _RESULTS:
        with tempfile.TemporaryDirectory(prefix="interpreter-child-") as tmp:
            _RESULTS[key] = _run_file(item.path, names, item.config.rootpath, Path(tmp))
    outcome, text = _RESULTS[key].get(item.name, ("missing", "the child pytest did not report this test"))
    if outcome == "skipped":
        pytest.skip(f"skipped in the interpreter child: {text.strip()[:500]}")
    if outcome != "passed":
        pytest.fail(f"in the interpreter child (TRITON_INTERPRET=1): {outcome}\n{text}", pytrace=False)


def redirect(items, wanted) -> None:
    """In the parent: every item with ``wanted(item)`` runs in the child instead (one child per
    file, covering that file's wanted items of this session)."""
    if in_child():
        return
    by_file: dict[str, list] = {}
    for item in items:
        if wanted(item):
            by_file.setdefault(str(item.path), []).append(item)
    for group in by_file.values():
        names = [it.name for it in group]
        for it in group:
            it.runtest = (lambda it=it, names=names: _child_runtest(it, names))


def redirect_marked(items, conftest_file: str) -> None:
    """``redirect`` for the ``interpreter``-marked items in the directory of ``conftest_file``
    (each conftest redirects its own directory's tests; pytest calls every conftest's hook with
    all items)."""
    here = str(Path(conftest_file).resolve().parent)
    redirect(items, lambda it: str(it.path).startswith(here + os.sep)
             and it.get_closest_marker("interpreter") is not None)
