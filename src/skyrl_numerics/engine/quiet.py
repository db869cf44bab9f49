"""A quiet terminal for commands that start vLLM engines: engine output goes to a log file.

vLLM logs ~150 INFO lines per engine from three processes (the caller, ``EngineCore``, the
worker), and libraries it imports print to stderr on their own (torchao's "Failed to load
.../_C_mxfp8...so", torch C++ warnings, safetensors progress bars). Those processes are *spawned*:
they do not share Python's ``logging`` state with the caller, but they inherit its file
descriptors 1 and 2. :class:`EngineLog` therefore redirects fds 1 and 2 (and ``sys.stdout`` /
``sys.stderr``, and vLLM's own stream handlers) to a temporary log file while it is active; every
engine started inside it writes there for its whole life. The terminal keeps a duplicate of the
original stdout, :attr:`EngineLog.terminal`, for progress bars, the table and the paths written.
On exit everything is restored; :meth:`EngineLog.keep` moves the log to its final place
(``OUT/vllm.log``), otherwise it is deleted (bad input leaves nothing behind).

Separately, :func:`install_vllm_log_filters` drops one record that is expected by design: with
``skip_tokenizer_init=True`` (prompts are token ids) ``vllm.LLM()`` still warms up the chat
template (``vllm/renderers/base.py``, ``BaseRenderer.warmup``), which needs a tokenizer, and
logs the resulting ``ValueError("Tokenizer not available when `skip_tokenizer_init=True`")`` as a
warning with its traceback. The filter removes exactly that record (message and exception type and
text checked), in the terminal and in the log alike; every other warning passes.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path


class NoTokenizerWarmupFilter(logging.Filter):
    """Drop vLLM's "Chat template warmup failed" warning when its cause is only that the engine
    runs without a tokenizer (``skip_tokenizer_init=True``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != "Chat template warmup failed":
            return True
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, ValueError) and "skip_tokenizer_init" in str(exc))


# the logger of vllm/renderers/base.py (vLLM names loggers by module)
_RENDERER_LOGGER = "vllm.renderers.base"


def install_vllm_log_filters() -> None:
    """Install :class:`NoTokenizerWarmupFilter` on vLLM's renderer logger (idempotent). The
    warm-up runs in the process that constructs ``vllm.LLM``, so this process is enough."""
    lg = logging.getLogger(_RENDERER_LOGGER)
    if not any(isinstance(f, NoTokenizerWarmupFilter) for f in lg.filters):
        lg.addFilter(NoTokenizerWarmupFilter())


def _terminal_stream():
    """A text stream on the terminal that survives redirecting fd 1: a dup of fd 1 when
    ``sys.stdout`` writes to it, else ``sys.stdout`` itself (e.g. a capture object)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return sys.stdout, False
    if fd != 1:
        return sys.stdout, False
    sys.stdout.flush()
    return os.fdopen(os.dup(1), "w", buffering=1, encoding=getattr(sys.stdout, "encoding", None)
                     or "utf-8", errors="replace"), True


class EngineLog:
    """``with EngineLog(verbose=False) as log:`` — see the module docstring. ``log.terminal`` is
    the stream to print to; ``log.keep(path)`` keeps the log there (call it inside the block or
    after it). ``verbose=True``: nothing is redirected (``log.terminal`` is ``sys.stdout``)."""

    def __init__(self, verbose: bool = False):
        self.verbose = verbose
        self.path: Path | None = None     # the temp log while active
        self.kept: Path | None = None
        self.terminal = sys.stdout
        self._own_terminal = False
        self._saved_fds = None
        self._saved_sys = None
        self._handlers: list = []
        self._rich_saved = None

    def __enter__(self) -> "EngineLog":
        install_vllm_log_filters()
        if self.verbose:
            return self
        fd, name = tempfile.mkstemp(prefix="skyrl-numerics-vllm-", suffix=".log")
        self.path = Path(name)
        self.terminal, self._own_terminal = _terminal_stream()
        for s in (sys.stdout, sys.stderr):
            try:
                s.flush()
            except Exception:
                pass
        self._saved_fds = (os.dup(1), os.dup(2))
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        self._log = open(self.path, "a", buffering=1, encoding="utf-8", errors="replace")
        self._saved_sys = (sys.stdout, sys.stderr)
        sys.stdout = sys.stderr = self._log
        # handlers configured before (vLLM's own, bound to the old sys.stdout object)
        for h in logging.getLogger("vllm").handlers:
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                self._handlers.append((h, h.stream))
                h.setStream(self._log)
        # rich's global console (progress bars created without a console) -> the terminal
        try:
            import rich

            con = rich.get_console()
            self._rich_saved = (con, dict(con.__dict__))
            rich.reconfigure(file=self.terminal, width=None if _isatty(self.terminal) else 220)
        except Exception:  # pragma: no cover
            self._rich_saved = None
        return self

    def keep(self, dest: str | os.PathLike) -> Path:
        """Keep the log at ``dest`` (parent created); engines still running keep appending to it
        when it stays on the same filesystem (moved, not copied)."""
        dest = Path(dest)
        if self.path is None:
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._log.flush()
        except Exception:
            pass
        try:
            os.replace(self.path, dest)
        except OSError:
            shutil.copyfile(self.path, dest)
            self.path.unlink(missing_ok=True)
        self.kept, self.path = dest, None
        return dest

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.verbose:
            return
        for h, stream in self._handlers:
            h.setStream(stream)
        # handlers vLLM configured while this was active write to the log stream: they stay
        # there (vLLM logs its engines' shutdown at interpreter exit), so it is not closed then
        late = any(isinstance(h, logging.StreamHandler) and h.stream is self._log
                   for h in logging.getLogger("vllm").handlers)
        if self._rich_saved is not None:
            con, d = self._rich_saved
            con.__dict__.clear()
            con.__dict__.update(d)
        try:
            self._log.flush()
        except Exception:
            pass
        sys.stdout, sys.stderr = self._saved_sys
        os.dup2(self._saved_fds[0], 1)
        os.dup2(self._saved_fds[1], 2)
        for fd in self._saved_fds:
            os.close(fd)
        if not late:
            self._log.close()
        if self._own_terminal:
            try:
                self.terminal.flush()
                self.terminal.close()
            except Exception:
                pass
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except Exception:
        return False
