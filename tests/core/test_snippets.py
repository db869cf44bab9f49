"""Every ```python block in README.md and docs/*.md runs as written (docs/cli.md, "The Python
snippets"): saved to a file and run with ``python file.py`` in an empty folder. A block marked
``<!-- snippet: fragment (why) -->`` on the line right above its fence is only compiled. Blocks
that start a vLLM engine are ``vllm`` + ``slow`` and must keep the engine under
``if __name__ == "__main__":`` (vLLM's engine core is a spawned process that imports the script
again)."""
from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\s*$")
MARKER = re.compile(r"^<!-- snippet: fragment \((?P<why>.*)\) -->\s*$")
ENGINE_CALLS = {"VLLMGenerator", "get_generator"}
# keeps this file's run well under 3 minutes on 2 cores: each engine snippet costs ~30-60 s
MAX_ENGINE_SNIPPETS = 1


@dataclass(frozen=True)
class Snippet:
    doc: Path
    line: int            # the fence's line, 1-based
    code: str
    fragment: str | None  # the marker's reason; None: runs as written

    @property
    def name(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"

    @property
    def engine_calls(self) -> list[ast.Call]:
        return [n for n in ast.walk(ast.parse(self.code)) if isinstance(n, ast.Call)
                and getattr(n.func, "id", getattr(n.func, "attr", None)) in ENGINE_CALLS]


def read_snippets(doc: Path) -> list[Snippet]:
    lines = doc.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            start = i
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                i += 1
            assert i < len(lines), f"{doc.name}:{start + 1}: unclosed ```python block"
            m = MARKER.match(lines[start - 1]) if start else None
            out.append(Snippet(doc, start + 1, "\n".join(lines[start + 1:i]) + "\n",
                               m.group("why").strip() if m else None))
        i += 1
    return out


SNIPPETS = [s for d in DOCS for s in read_snippets(d)]
RUNNABLE = [s for s in SNIPPETS if s.fragment is None]


def _param(s: Snippet):
    marks = [pytest.mark.vllm, pytest.mark.slow] if s.engine_calls else []
    return pytest.param(s, id=s.name, marks=marks)


def _is_main_guard(node: ast.stmt) -> bool:
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    sides = [node.test.left, *node.test.comparators]
    return (any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides)
            and any(isinstance(x, ast.Constant) and x.value == "__main__" for x in sides))


def test_the_docs_have_snippets_and_markers_sit_on_fences():
    assert len(SNIPPETS) >= 20 and RUNNABLE
    assert any(s.doc.name == "README.md" and s.fragment is None and s.engine_calls
               for s in SNIPPETS), "the README's engine snippet must run as written"
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.startswith("<!-- snippet:"):
                assert MARKER.match(line), f"{doc.name}:{i + 1}: malformed marker {line!r}"
                assert MARKER.match(line).group("why").strip(), f"{doc.name}:{i + 1}: say why"
                assert i + 1 < len(lines) and FENCE.match(lines[i + 1]), \
                    f"{doc.name}:{i + 1}: a snippet marker must sit right above a ```python fence"


@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda s: s.name)
def test_every_snippet_compiles(snippet):
    compile(snippet.code, snippet.name, "exec")


@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if s.engine_calls], ids=lambda s: s.name)
def test_engine_snippets_keep_the_engine_under_the_main_guard(snippet):
    """Runnable or fragment: a reader copies it into a script, and vLLM's spawned engine core
    imports that script again."""
    for stmt in ast.parse(snippet.code).body:
        if _is_main_guard(stmt) or isinstance(stmt, (ast.FunctionDef, ast.ClassDef)):
            continue
        calls = [n for n in ast.walk(stmt) if isinstance(n, ast.Call)
                 and getattr(n.func, "id", getattr(n.func, "attr", None)) in ENGINE_CALLS]
        assert not calls, (f"{snippet.name}, line {stmt.lineno}: an engine starts outside "
                           '`if __name__ == "__main__":`')


def test_few_snippets_start_engines():
    engines = [s.name for s in RUNNABLE if s.engine_calls]
    assert len(engines) <= MAX_ENGINE_SNIPPETS, (
        f"{engines}: each runnable engine snippet costs ~30-60 s here; merge them, or mark the "
        "others fragments")


@pytest.mark.parametrize("snippet", [_param(s) for s in RUNNABLE])
def test_snippet_runs_as_written(snippet, tmp_path):
    if snippet.engine_calls and importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    script = tmp_path / "snippet.py"
    script.write_text(snippet.code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    if not env.get("SKYRL_NUMERICS_CACHE"):   # as tests/conftest.py: the repo's .cache
        env.setdefault("SKYRL_NUMERICS_CACHE_DIR", str(REPO / ".cache"))
    try:
        proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=300 if snippet.engine_calls else 120)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"{snippet.name} ran past {e.timeout} s; its output ends:\n"
                    + "\n".join(out.splitlines()[-60:]))
    if proc.returncode != 0:
        pytest.fail(f"{snippet.name} exited {proc.returncode}; its output ends:\n"
                    + "\n".join(proc.stdout.splitlines()[-60:]))
