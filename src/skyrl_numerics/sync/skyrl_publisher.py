"""Publish weights in SkyRL 0.4's checkpoint-delta layout (``skyrl_layout.py``), so SkyRL's own
receiver (``LocalCheckpointStore.fetch``, its vLLM ``delta`` backend) applies them.

``SkyrlLayoutPublisher(root, base)``: version 0 is the base checkpoint (the ``base_model_path`` the
SkyRL receivers start from; ``version=h`` continues a stream whose receivers hold ``base`` as
version ``h``); each :meth:`publish` writes version ``v`` against ``v - 1``::

    payload(name)  = zstd_level1(b_v XOR b_{v-1})     only where the XOR is not all zero
    checksum(name) = xxh3_128(b_v).hexdigest()

into ``delta-%08d/delta-rank00000-file%06d.safetensors`` (a new file past ``max_file_bytes`` of
payload, as SkyRL's ``max_file_size_in_gb``), each file written atomically, then
``delta-%08d/manifest.json`` last. A tensor the base lacks, or of another dtype or shape, is an
``InputError`` naming it (SkyRL's publisher skips unknown names with a warning and casts dtypes);
tensors not given are unchanged. The publisher keeps one copy of the last published bytes.
"""
from __future__ import annotations

import os
import time
from dataclasses import replace

import numpy as np

from skyrl_numerics.errors import InputError
from skyrl_numerics.sync.codec import Zstd, digest, dtype_name, tensor_bytes, xor_bytes
from skyrl_numerics.sync.skyrl_layout import (SkyrlEntry, SkyrlManifest, list_versions,
                                              manifest_rel, payload_file_name, version_dir)
from skyrl_numerics.sync.skyrl_receiver import load_checkpoint
from skyrl_numerics.sync.store import SyncStore


class SkyrlLayoutPublisher:
    """Writes successive versions of a state dict as a SkyRL 0.4 checkpoint-delta store."""

    def __init__(self, root: str | os.PathLike, base, *, version: int = 0,
                 max_file_bytes: int = 1 << 30, level: int = 1):
        self.store = SyncStore(root)
        if list_versions(self.store):
            raise InputError(f"{self.store.url} already holds SkyRL versions; a publisher starts "
                             "from its base (use an empty sync_dir)", field="root")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise InputError(f"version {version!r} is not a non-negative integer", field="version")
        self._prev = {n: (dtype_name(t.dtype), tuple(t.shape), tensor_bytes(t.contiguous()).copy())
                      for n, t in load_checkpoint(base).items()}
        self.version = version    # what ``base`` is: 0, or the version receivers already hold
        self.max_file_bytes = int(max_file_bytes)
        self.zstd = Zstd(level)
        self.last_publish_s = 0.0

    def _encode(self, state) -> list[tuple[SkyrlEntry, bytes, np.ndarray]]:
        import torch

        out = []
        for name, t in state.items():
            if name not in self._prev:
                raise InputError(f"tensor {name!r} is not in the base checkpoint", field=name)
            if not isinstance(t, torch.Tensor):
                raise InputError(f"expected a torch.Tensor, got {type(t).__name__}", field=name)
            t = t.detach().to("cpu").contiguous()
            dt, shape, prev = self._prev[name]
            if (dtype_name(t.dtype), tuple(t.shape)) != (dt, shape):
                raise InputError(f"tensor {name!r} is {dtype_name(t.dtype)}{list(t.shape)}, the base "
                                 f"checkpoint holds {dt}{list(shape)}", field=name)
            new = tensor_bytes(t)
            patch = xor_bytes(new, prev)
            if not patch.any():
                continue
            blob = self.zstd.compress(patch)
            out.append((SkyrlEntry(name=name, dtype=dt, shape=shape, uncompressed_num_bytes=new.size,
                                   compressed_num_bytes=len(blob), payload_file="", payload_key=name,
                                   checksum=digest(new, "xxh3-128").partition(":")[2]),
                        blob, new.copy()))
        return out

    def publish(self, state) -> SkyrlManifest:
        """Write ``state`` (checkpoint names -> tensors) as the next version; returns its manifest.
        Nothing of a failed publish becomes visible (the manifest is written last)."""
        import torch
        from safetensors.torch import save

        t0 = time.perf_counter()
        v = self.version + 1
        encoded = self._encode(state)
        files, entries, batch, size = [], [], {}, 0

        def flush():
            nonlocal batch, size
            if batch:
                self.store.write(f"{version_dir(v)}/{files[-1]}", save(batch))
                batch, size = {}, 0

        for e, blob, _ in encoded:
            if not files or (batch and size + len(blob) > self.max_file_bytes):
                flush()
                files.append(payload_file_name(0, len(files)))
            batch[e.name] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
            size += len(blob)
            entries.append(replace(e, payload_file=files[-1]))
        flush()
        m = SkyrlManifest(version=v, base_version=v - 1, tensors=tuple(entries),
                          payload_files=tuple(files))
        self.store.write(manifest_rel(v), m.to_json())
        for e, _, new in encoded:
            self._prev[e.name] = (e.dtype, e.shape, new)
        self.version = v
        self.last_publish_s = time.perf_counter() - t0
        return m
