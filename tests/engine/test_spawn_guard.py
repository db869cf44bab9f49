"""An engine started from a script with no ``if __name__ == "__main__":`` guard: vLLM's engine core is
a spawned process that runs the script again, and there ``VLLMGenerator`` refuses with one line
(engine/generator.py) instead of vLLM's "Engine core initialization failed" traceback."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from skyrl_numerics.engine import generator as G
from skyrl_numerics.errors import InputError

REPO = Path(__file__).resolve().parents[2]


def test_refused_while_a_spawned_child_reruns_the_script(monkeypatch, tmp_path):
    # what a spawn child runs: the user's script as module code named __mp_main__
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)   # restored after the test
    code = compile("VLLMGenerator('/no/such/model')", "user_script.py", "exec")
    with pytest.raises(InputError, match=r'under `if __name__ == "__main__":`') as e:
        exec(code, {"__name__": "__mp_main__", "VLLMGenerator": G.VLLMGenerator})
    assert "\n" not in str(e.value)
    assert (tmp_path / f"skyrl_numerics-spawn-reimport-{os.getppid()}").exists()  # for the parent


def test_not_refused_in_the_main_script_or_a_guarded_child(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setitem(sys.modules, "vllm", None)   # `from vllm import LLM`: ImportError at once
    # __main__ module code, and a function of __mp_main__ called after bootstrapping (a
    # multiprocessing target): both go on to import vLLM
    for name, src in [("__main__", "VLLMGenerator('/no/such/model')"),
                      ("__mp_main__", "def target():\n    VLLMGenerator('/no/such/model')\n")]:
        g = {"__name__": name, "VLLMGenerator": G.VLLMGenerator}
        with pytest.raises(ImportError):
            exec(compile(src, "user_script.py", "exec"), g)
            g["target"]()
    assert not list(tmp_path.iterdir())


@pytest.mark.vllm
@pytest.mark.slow
def test_unguarded_script_fails_fast_with_one_line(tmp_path, qwen_moe_dir):
    if importlib.util.find_spec("vllm") is None:   # not imported here: the script does
        pytest.skip("vllm is not installed")
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(f"""\
        from skyrl_numerics.trainer import get_generator
        gen = get_generator({str(qwen_moe_dir)!r})   # no `if __name__ == "__main__":`
        print("GENERATED", gen.generate([[1, 2, 3]], max_tokens=2).num_response_tokens)
        """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    took = time.perf_counter() - t0
    tail = "\n".join(err.splitlines()[-40:])
    assert proc.returncode == 1, tail
    assert "GENERATED" not in out, tail
    one_line = f"InputError: {G.SPAWN_REIMPORT_MESSAGE}"
    # the child: the line alone, no traceback of its own
    assert err.count(one_line) == 2, tail          # the child's line, the parent's last line
    assert err.rstrip().endswith(one_line), tail   # the parent raises the same line
    assert "Engine core initialization failed" not in err, tail
    assert "bootstrapping phase" not in err, tail  # multiprocessing's own message
    assert err.count("Traceback (most recent call last)") == 1, tail   # the parent's, short
    assert not list(Path(tempfile.gettempdir()).glob(f"skyrl_numerics-spawn-reimport-{proc.pid}")), \
        "the parent left the child's marker behind"
    print(f"unguarded script failed in {took:.1f} s")
