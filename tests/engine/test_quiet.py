"""The quiet terminal: engine processes' output to a log, the no-tokenizer warm-up record filtered."""
from __future__ import annotations

import io
import logging
import subprocess
import sys

from skyrl_numerics.engine.quiet import EngineLog, NoTokenizerWarmupFilter, install_vllm_log_filters


def _record(msg, exc=None):
    exc_info = (type(exc), exc, None) if exc is not None else None
    return logging.LogRecord("vllm.renderers.base", logging.WARNING, __file__, 1, msg, (), exc_info)


def test_filter_drops_only_the_no_tokenizer_warmup():
    f = NoTokenizerWarmupFilter()
    no_tok = ValueError("Tokenizer not available when `skip_tokenizer_init=True`")
    assert not f.filter(_record("Chat template warmup failed", no_tok))
    assert f.filter(_record("Chat template warmup failed", ValueError("template syntax error")))
    assert f.filter(_record("Chat template warmup failed", RuntimeError("skip_tokenizer_init")))
    assert f.filter(_record("Chat template warmup failed"))
    assert f.filter(_record("Using None for EOS token id because tokenizer is not initialized"))


def test_filter_installed_on_vllms_renderer_logger():
    install_vllm_log_filters()
    install_vllm_log_filters()  # idempotent
    lg = logging.getLogger("vllm.renderers.base")
    assert sum(isinstance(f, NoTokenizerWarmupFilter) for f in lg.filters) == 1
    stream = io.StringIO()
    h = logging.StreamHandler(stream)
    lg.addHandler(h)
    try:
        try:
            raise ValueError("Tokenizer not available when `skip_tokenizer_init=True`")
        except ValueError:
            lg.warning("Chat template warmup failed", exc_info=True)
        lg.warning("something else")
    finally:
        lg.removeHandler(h)
    assert "warmup" not in stream.getvalue() and "something else" in stream.getvalue()


def test_child_processes_write_to_the_log_not_the_terminal(tmp_path, capfd):
    lg = logging.getLogger("vllm")
    before = io.StringIO()
    h = logging.StreamHandler(before)
    lg.addHandler(h)
    try:
        with EngineLog() as elog:
            subprocess.run([sys.executable, "-c", "import sys, os; print('child stdout'); "
                            "print('child stderr', file=sys.stderr); os.write(2, b'fd2 raw\\n')"],
                           check=True)
            print("python print in the parent")
            lg.warning("vllm says hi")
            print("for the terminal", file=elog.terminal)
            kept = elog.keep(tmp_path / "out" / "vllm.log")
        lg.warning("after")
    finally:
        lg.removeHandler(h)
    term = capfd.readouterr()
    assert "for the terminal" in term.out
    for s in ("child stdout", "child stderr", "fd2 raw", "python print", "vllm says hi"):
        assert s not in term.out + term.err, s
    log = kept.read_text()
    for s in ("child stdout", "child stderr", "fd2 raw", "python print in the parent", "vllm says hi"):
        assert s in log, s
    # a handler that existed before is restored afterwards
    assert "after" in before.getvalue() and "vllm says hi" not in before.getvalue()


def test_log_dropped_unless_kept_and_verbose_redirects_nothing(capfd):
    with EngineLog() as elog:
        path = elog.path
        print("noise")
    assert not path.exists()
    assert "noise" not in capfd.readouterr().out
    with EngineLog(verbose=True) as elog:
        assert elog.path is None
        print("shown")
    assert "shown" in capfd.readouterr().out
