"""Shared fixtures: tiny checkpoints (built once, cached by config hash) and one vLLM engine per session."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from hypothesis import settings

REPO = Path(__file__).resolve().parents[1]

# Hypothesis: under CI (CI=true) every run draws the same examples (derandomized, no example
# database), so a submission cannot fail on a draw nobody saw; locally each run explores new
# examples and remembers failures. HYPOTHESIS_PROFILE=ci|dev picks one by hand. A test's own
# @settings(max_examples=...) keeps its count under either profile.
settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE")
                      or ("ci" if os.environ.get("CI", "").lower() in ("1", "true", "yes") else "dev"))
# Keep built checkpoints, kernels and probes inside the repo's ignored .cache/ unless the user
# chose a place (SKYRL_NUMERICS_CACHE is the old name of the variable).
if not os.environ.get("SKYRL_NUMERICS_CACHE"):
    os.environ.setdefault("SKYRL_NUMERICS_CACHE_DIR", str(REPO / ".cache"))
# vLLM CPU engines started without a memory setting reserve this share of RAM (weights + KV cache;
# host.cpu_memory_share, default 0.1 = 2.4 GB of a 24 GB host, mostly zeroed KV blocks the tiny
# models never use): 0.06 leaves each tiny engine ~0.7 GB of KV, and two test workers room for
# their engines together. Inherited by every engine and server the tests start.
os.environ.setdefault("SKYRL_NUMERICS_CPU_MEMORY_SHARE", "0.06")
# vLLM CPU's default thread binding ("auto") pins every engine worker's OpenMP threads to the
# last core of its NUMA node and reserves the rest: on this 2-core host each engine the workers
# start sits on CPU 0, all of them together, while CPU 1 idles. The suite's engines are tiny and
# many; unbound, the OS spreads them (measured: two e2e files on two workers, 260.7 s -> 202.5 s,
# mean idle 18 % -> 12 %). A user's serving engine keeps vLLM's default. Inherited by every engine,
# server and child process the tests start.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def pytest_report_header(config):
    """The ISA these results hold for: torch's CPU capability, the host's ISA flags (and caps set
    in the environment), the vLLM CPU kernel build this host loads and what it lacks."""
    from skyrl_numerics import host

    h = host.host_info()
    flags = " ".join(f for f, on in h["isa_flags"].items() if on) or "none"
    capped = " ".join(f"{k}={v}" for k, v in h["isa_caps"].items())
    lines = [f"host: {h['cpu_model']} ({h['cpu_count']} CPUs), ISA {h['isa']} [{flags}], torch CPU "
             f"capability {h['torch_cpu_capability']}" + (f", capped by {capped}" if capped else "")]
    try:
        caps = host.vllm_capabilities()
    except ValueError as e:   # InputError: a bad SKYRL_NUMERICS_ASSUME_VLLM_BUILD
        return lines + [f"vLLM: {e}"]
    if caps.get("error"):
        lines.append(f"vLLM {caps.get('vllm')}: {caps['error']}")
    else:
        lacks = [k for k, f in caps["features"].items() if f["ok"] is False]
        lines.append(f"vLLM {caps['vllm']}: kernel build {caps['build']} ({caps['decided_by']}); "
                     f"cannot run: {', '.join(lacks) or 'nothing listed'}")
    return lines


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

    # routes captured inside the engine (R3); the doctor asks for the same engine, so one start-up
    gen = get_generator(qwen_moe_dir, capture_routes=True)
    yield gen
    gen.close()


@pytest.fixture(scope="session")
def vllm_qwen_invariant(qwen_moe_dir):
    """The real vLLM CPU engine running the batch-invariant Qwen3-MoE (out-of-tree model)."""
    pytest.importorskip("vllm")
    from skyrl_numerics.trainer import get_generator

    # routes captured from the invariant routers; the doctor's batch-invariant scenario asks for
    # the same engine
    gen = get_generator(qwen_moe_dir, batch_invariant=True, capture_routes=True)
    yield gen
    gen.close()


@pytest.fixture(scope="session")
def vllm_deepseek_invariant(deepseek_v3_dir):
    """The real vLLM CPU engine running the batch-invariant DeepSeek-V3 (absorbed MLA over its
    own paged latent cache, out-of-tree model)."""
    pytest.importorskip("vllm")
    from skyrl_numerics.trainer import get_generator

    gen = get_generator(deepseek_v3_dir, batch_invariant=True, capture_routes=True)
    yield gen
    gen.close()


@pytest.fixture
def fake_engines(monkeypatch):
    """``install(make)``: the doctor's engines become ``make(model_dir, **kw)`` stand-ins —
    ``VLLMGenerator`` is ``make``, ``get_generator`` caches one per argument set as the real one
    does."""
    from skyrl_numerics.engine import generator

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


@pytest.fixture(autouse=True)
def _device_default(request):
    """A test parametrized by ``device`` (tests/device_cases.py) creates its tensors there:
    that device is the default of torch's factory functions for the test when it is not the CPU
    (CPU tests run exactly as they are written)."""
    callspec = getattr(request.node, "callspec", None)
    device = callspec.params.get("device") if callspec is not None else None
    if device is None:
        yield
        return
    from device_cases import resolve

    if resolve(device) == "cpu":
        yield
        return
    import torch

    with torch.device(resolve(device)):
        yield


@pytest.fixture(autouse=True)
def _strict_batch_invariant_mode(monkeypatch):
    """``batch_invariant_mode()`` is strict in every test (and in the processes a test starts): an
    aten op the mode neither overrides nor lists as row-local raises ``NotInvariant`` naming it
    instead of running stock with a warning (``kernels/mode_watch.py``)."""
    monkeypatch.setenv("SKYRL_NUMERICS_MODE_STRICT", "1")


# ---- where the suite's time goes: seconds per test file (setup + call + teardown) -------------
_FILE_SECONDS: dict[str, float] = {}
#: seconds per test file measured in a fresh-clone ``make test`` (two workers, this repo's CI host);
#: the scheduler below starts the longest units first. ``make test`` rewrites
#: ``.cache/test_file_seconds.json`` after each run: copy it here when the suite's shape changes.
FILE_SECONDS_PATH = REPO / "tests" / "file_seconds.json"


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """The 15 test files that took longest, beside ``--durations`` (the slowest single phases):
    the suite's budget is spent per file (module engines and servers), so that is where to look.
    The whole table goes to ``.cache/test_file_seconds.json`` (the source of ``file_seconds.json``)."""
    if not _FILE_SECONDS:
        return
    total = sum(_FILE_SECONDS.values())
    terminalreporter.write_sep("=", f"slowest 15 test files ({total:.0f} s in all tests)")
    for path, s in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:15]:
        terminalreporter.write_line(f"{s:8.1f}s  {100 * s / total:5.1f}%  {path}")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    out = REPO / ".cache" / "test_file_seconds.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({k: round(v, 1) for k, v in sorted(_FILE_SECONDS.items())}, indent=1))


# ---- two workers (``make test`` runs ``pytest -n 2 --dist loadfile``, pytest-xdist) ------------
#: the session engines above (~2 GB of RAM each): every test file that names one runs in one worker,
#: so each starts once per run, not once per worker
SESSION_ENGINES = ("vllm_qwen", "vllm_qwen_invariant", "vllm_deepseek_invariant")
_ENGINE_USER = re.compile(r"\b(" + "|".join(SESSION_ENGINES) + r")\b")
#: the unit of all session-engine users
ENGINE_UNIT = "session engines"
#: a test file not in ``file_seconds.json`` is expected to take this long per test
UNKNOWN_SECONDS_PER_TEST = 1.0


def session_engine_files(root: Path = REPO / "tests") -> frozenset:
    """Test files (paths relative to the repo, as in node ids) whose source names a session engine."""
    return frozenset(str(p.relative_to(REPO)) for p in root.rglob("test_*.py")
                     if _ENGINE_USER.search(p.read_text()))


def unit_seconds(units: dict, file_seconds: dict, engine_files: frozenset) -> dict:
    """Expected seconds of each work unit (``{unit: {nodeid: done}}``): the measured seconds of its
    files, or ``UNKNOWN_SECONDS_PER_TEST`` per test for a file never measured."""
    out = {}
    for unit, nodeids in units.items():
        files = sorted(engine_files) if unit == ENGINE_UNIT else [unit]
        counts = {}
        for nodeid in nodeids:
            path = nodeid.split("::", 1)[0]
            counts[path] = counts.get(path, 0) + 1
        out[unit] = sum(file_seconds.get(f, UNKNOWN_SECONDS_PER_TEST * counts.get(f, 0))
                        for f in files)
    return out


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with two changes: the files that use a session engine are one unit (xdist
    3.8's ``loadgroup`` marks do not reach its scheduler under pytest 9: it renames
    ``item._nodeid``, which pytest 9's ``nodeid`` no longer reads), and the units go out longest
    first by ``file_seconds.json`` (longest-processing-time order: a long file drawn last would
    leave one worker idle while the other finishes it). Other ``--dist`` modes are xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    engine_files = session_engine_files()
    file_seconds = (json.loads(FILE_SECONDS_PATH.read_text())
                    if FILE_SECONDS_PATH.exists() else {})

    class FilesAndEngineUsers(LoadScopeScheduling):
        _longest_first = False

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return ENGINE_UNIT if path in engine_files else path

        def _assign_work_unit(self, node) -> None:
            if not self._longest_first:   # the queue is complete before the first assignment
                seconds = unit_seconds(self.workqueue, file_seconds, engine_files)
                ordered = sorted(self.workqueue.items(), key=lambda kv: -seconds[kv[0]])
                self.workqueue.clear()
                self.workqueue.update(ordered)
                self._longest_first = True
            super()._assign_work_unit(node)

    return FilesAndEngineUsers(config, log)
