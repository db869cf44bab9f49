"""Write files and directories so that a reader never sees half of one.

``atomic_file(path)`` / ``atomic_dir(path)`` yield a temporary path next to the target; when the
``with`` block ends normally it is renamed onto the target (one ``rename``, atomic on POSIX), and
when it raises, the temporary is removed and the target is left as it was.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp file path in ``path``'s folder; rename it to ``path`` on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp directory next to ``path``; rename it to ``path`` on success.

    For content-addressed caches: if another process created ``path`` meanwhile, its (identical)
    copy is kept and ours is dropped."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        yield tmp
        try:
            os.replace(tmp, path)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
