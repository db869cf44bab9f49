"""Where weight-sync files live: a local directory or any fsspec URL, with atomic writes.

``SyncStore(root)``: ``root`` is a path (``/data/sync``, ``file:///data/sync``) or an fsspec URL
(``s3://bucket/run7``, ``gs://...``, ``memory://run7``). Every write goes to a temporary name in
the same folder and is then renamed into place (``os.replace`` locally, ``fs.mv`` on fsspec), so a
reader never sees half a file under its final name. Object stores make a single ``put`` atomic;
there ``mv`` is copy + delete, which keeps the same guarantee for the final name.
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path

from skyrl_numerics.errors import InputError


class SyncStore:
    """Bytes under relative paths (``"manifests/000000000003.json"``) below one root."""

    def __init__(self, root: str | os.PathLike):
        root = str(root)
        self.url = root
        if "://" in root and not root.startswith("file://"):
            import fsspec

            self.fs, self.root = fsspec.core.url_to_fs(root)
            self.local = False
        else:
            self.fs = None
            self.root = root[len("file://"):] if root.startswith("file://") else root
            self.local = True

    def _path(self, rel: str) -> str:
        if not rel:
            return self.root
        return os.path.join(self.root, rel) if self.local else f"{self.root.rstrip('/')}/{rel}"

    def write(self, rel: str, data) -> None:
        """Write ``data`` (bytes-like) to ``rel`` atomically: temp name, then rename."""
        final = self._path(rel)
        tmp = f"{final}.tmp-{uuid.uuid4().hex[:12]}"
        if self.local:
            Path(final).parent.mkdir(parents=True, exist_ok=True)
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, final)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        else:
            parent = final.rsplit("/", 1)[0]
            self.fs.makedirs(parent, exist_ok=True)
            self.fs.pipe_file(tmp, bytes(data))
            try:
                self.fs.mv(tmp, final)
            finally:
                if self.fs.exists(tmp):
                    self.fs.rm(tmp)

    def read(self, rel: str, *, field: str | None = None) -> bytes:
        """The bytes at ``rel``; ``InputError`` naming the file (and ``field``) if it is missing."""
        path = self._path(rel)
        try:
            if self.local:
                with open(path, "rb") as f:
                    return f.read()
            return self.fs.cat_file(path)
        except FileNotFoundError:
            raise InputError(f"file {rel!r} is missing under {self.url}", field=field) from None
        except IsADirectoryError:
            raise InputError(f"{rel!r} under {self.url} is a directory, not a file", field=field) from None
        except OSError as e:
            raise InputError(f"cannot read {rel!r} under {self.url} ({e.strerror or e})", field=field) from None

    def exists(self, rel: str) -> bool:
        path = self._path(rel)
        return os.path.exists(path) if self.local else self.fs.exists(path)

    def list(self, rel_dir: str) -> list[str]:
        """File names (not paths) directly inside ``rel_dir`` (``""``: the root); empty if it does
        not exist."""
        path = self._path(rel_dir)
        if self.local:
            return sorted(os.listdir(path)) if os.path.isdir(path) else []
        if not self.fs.exists(path):
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(path, detail=False))

    def remove_tree(self, rel: str) -> None:
        """Delete a file or folder (used by pruning)."""
        path = self._path(rel)
        if self.local:
            import shutil

            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.unlink(path)
        elif self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def __repr__(self) -> str:
        return f"SyncStore({self.url!r})"
