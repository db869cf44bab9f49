"""The checks one tensor entry of a delta manifest gets, for both layouts a receiver reads: ours
(:mod:`.manifest`, ``manifests/<version>.json``) and SkyRL 0.4's (:mod:`.skyrl_layout`,
``delta-<version>/manifest.json``). Every failure is an ``InputError`` naming the version, the
tensor, its index and the field, before any payload is read or any weight is touched.

What both layouts share: a non-empty string ``name``; exactly the layout's keys; a ``dtype`` name
known to :func:`.codec.dtype_from_name`; a ``shape`` of at most ``MAX_DIMS`` non-negative ints; and
a byte count equal to ``prod(shape) * itemsize(dtype)`` (Python ints: no overflow) and at most
``MAX_TENSOR_BYTES``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from skyrl_numerics.errors import InputError
from skyrl_numerics.sync.codec import dtype_from_name

MAX_TENSOR_BYTES = 1 << 40    # refuse absurd sizes before allocating anything
MAX_DIMS = 32


def is_int(x) -> bool:
    """An int that is not a bool (JSON ``true`` parses to a Python int subclass)."""
    return isinstance(x, int) and not isinstance(x, bool)


def dtype_itemsize(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class EntryFields:
    """One manifest entry ``t`` (entry ``index`` of ``version``, read from ``source``)."""
    t: dict
    name: str
    index: int
    version: int
    source: str

    @classmethod
    def of(cls, t: Any, index: int, version: int, source: str, keys: tuple) -> "EntryFields":
        """The entry, once it is a dict with a non-empty string name and exactly ``keys``."""
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise InputError(f"version {version}: entry {index} has no non-empty string 'name'",
                             field="tensors", index=index, source=source)
        e = cls(t, t["name"], index, version, source)
        for key in t:
            if key not in keys:
                raise e.bad(key, "unknown field")
        for key in keys:
            if key not in t:
                raise e.bad(key, "missing field")
        return e

    def bad(self, key: str, msg: str) -> InputError:
        return InputError(f"version {self.version}, tensor {self.name!r}, field '{key}': {msg}",
                          field=self.name, index=self.index, source=self.source)

    def dtype(self):
        """The torch dtype its ``dtype`` names."""
        name = self.t["dtype"]
        dt = dtype_from_name(name) if isinstance(name, str) else None
        if dt is None:
            raise self.bad("dtype", f"unknown dtype {name!r}")
        return dt

    def shape(self) -> tuple:
        shape = self.t["shape"]
        if (not isinstance(shape, list) or len(shape) > MAX_DIMS
                or not all(is_int(s) and 0 <= s <= MAX_TENSOR_BYTES for s in shape)):
            raise self.bad("shape", f"{shape!r} is not a list of at most {MAX_DIMS} non-negative "
                                    f"integers")
        return tuple(shape)

    def nbytes(self, key: str, dtype, shape: tuple) -> int:
        """``t[key]``, checked to be the raw size of ``dtype`` x ``shape`` and within the limit."""
        n = self.t[key]
        expect = math.prod(shape) * dtype_itemsize(dtype)
        if not is_int(n) or n != expect:
            raise self.bad(key, f"{n!r} does not match {self.t['dtype']}{list(shape)} ({expect})")
        if expect > MAX_TENSOR_BYTES:
            raise self.bad(key, f"{expect} bytes is more than the {MAX_TENSOR_BYTES} allowed")
        return n
