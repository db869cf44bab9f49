"""Write files and directories so that a reader never sees half of one.

``atomic_file(path)`` / ``atomic_dir(path)`` yield a temporary path next to the target; when the
``with`` block ends normally it is renamed onto the target (one ``rename``, atomic on POSIX), and
when it raises, the temporary is removed and the target is left as it was. ``atomic_files(paths)``
does the same for several files written as one unit: none is renamed before all are written.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Iterator


@contextlib.contextmanager
def atomic_files(paths: Iterable[str | os.PathLike]) -> Iterator[list[Path]]:
    """Yield a temp file path in each of ``paths``' folders; when the block ends normally rename
    them, in order, to ``paths``. When the block (or a rename) raises, the temps not yet renamed
    are removed."""
    tmps: list[tuple[str, Path]] = []
    try:
        for path in map(Path, paths):
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
            os.close(fd)
            tmps.append((tmp, path))
        yield [Path(tmp) for tmp, _ in tmps]
        while tmps:
            os.replace(*tmps[0])
            tmps.pop(0)
    except BaseException:
        for tmp, _ in tmps:
            if os.path.exists(tmp):
                os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp file path in ``path``'s folder; rename it to ``path`` on success."""
    with atomic_files([path]) as (tmp,):
        yield tmp


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, *, replace: bool = False) -> Iterator[Path]:
    """Yield a temp directory next to ``path``; rename it to ``path`` on success.

    For content-addressed caches (the default): if another process created ``path`` meanwhile,
    its (identical) copy is kept and ours is dropped. With ``replace=True`` an existing ``path``
    is replaced: moved aside to ``.NAME.old-PID``, ours renamed into place, the old one removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        yield tmp
        if replace:
            old = None
            if path.exists():
                old = path.parent / f".{path.name}.old-{os.getpid()}"
                os.replace(path, old)
            os.replace(tmp, path)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            return
        try:
            os.replace(tmp, path)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
