"""The two-worker scheduler of ``make test`` (tests/conftest.py): session-engine users form one unit,
and units go out longest first by the measured seconds per file."""
from __future__ import annotations

from collections import OrderedDict

import conftest


class _Config:
    """What ``pytest_xdist_make_scheduler`` and xdist's LoadScopeScheduling read of the config."""

    class option:
        loadscopereorder = True
        tx = ["popen", "popen"]
        numprocesses = 2
        dist = "loadfile"
        maxschedchunk = None

    def getvalue(self, name):
        return getattr(self.option, name)


class _Worker:
    """Stands in for an xdist worker process: records the test indexes it is sent."""

    def __init__(self):
        self.sent = []

    def send_runtest_some(self, indexes):
        self.sent.append(list(indexes))


class _Log:
    """xdist's Producer: ``log.loadscopesched`` is another callable log."""

    def __call__(self, *args):
        pass

    def __getattr__(self, name):
        return self


def test_unit_seconds_sums_engine_users_and_estimates_unknown_files():
    units = {conftest.ENGINE_UNIT: {"tests/a.py::t": False, "tests/b.py::t": False},
             "tests/c.py": {"tests/c.py::t1": False, "tests/c.py::t2": False, "tests/c.py::t3": False}}
    seconds = conftest.unit_seconds(units, {"tests/a.py": 100.0, "tests/b.py": 20.0},
                                    frozenset({"tests/a.py", "tests/b.py"}))
    assert seconds[conftest.ENGINE_UNIT] == 120.0
    assert seconds["tests/c.py"] == 3 * conftest.UNKNOWN_SECONDS_PER_TEST


def test_the_longest_unit_goes_out_first(monkeypatch):
    monkeypatch.setattr(conftest, "session_engine_files", lambda: frozenset())
    sched = conftest.pytest_xdist_make_scheduler(_Config(), log=_Log())
    ids = ["tests/short.py::a", "tests/short.py::b", "tests/long.py::a"]
    worker = _Worker()
    sched.registered_collections = {worker: ids}
    sched.workqueue = OrderedDict([("tests/short.py", {ids[0]: False, ids[1]: False}),
                                   ("tests/long.py", {ids[2]: False})])
    real = conftest.unit_seconds
    monkeypatch.setattr(conftest, "unit_seconds", lambda units, fs, ef: real(
        units, {"tests/long.py": 500.0, "tests/short.py": 1.0}, ef))
    sched._assign_work_unit(worker)
    assert worker.sent == [[2]]            # long.py first, though it was queued second
    assert list(sched.workqueue) == ["tests/short.py"]
