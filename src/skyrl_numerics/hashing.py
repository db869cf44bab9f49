"""The project's two kinds of hash.

- Content digests, ``<algo>:<hex>``, of rollout files and weight-sync tensors: ``xxh3-128`` when
  ``xxhash`` is installed (about 20 GB/s), else ``blake2b-128`` (about 0.5 GB/s). Both detect
  corruption; neither is meant to resist a forger. :func:`hasher` gives the incremental object.
- Keys of JSON-able configs for caches and reports: :func:`json_key`, the first 16 hex digits of
  the sha256 of the canonical JSON (sorted keys).
"""
from __future__ import annotations

import hashlib
import json

from skyrl_numerics.errors import InputError

DIGEST_ALGOS = ("xxh3-128", "blake2b-128")


def hasher(algo: str):
    """A new incremental hash object (``update`` / ``hexdigest``) of digest algorithm ``algo``.
    ``xxh3-128`` raises ImportError without ``xxhash``; an unknown name raises InputError."""
    if algo == "xxh3-128":
        import xxhash

        return xxhash.xxh3_128()
    if algo == "blake2b-128":
        return hashlib.blake2b(digest_size=16)
    raise InputError(f"unknown digest algorithm {algo!r}", field="digest")


def default_algo() -> str:
    """``xxh3-128`` when ``xxhash`` imports, else ``blake2b-128``."""
    try:
        import xxhash  # noqa: F401

        return "xxh3-128"
    except ImportError:  # pragma: no cover - xxhash is in the cpu/gpu/dev extras
        return "blake2b-128"


def json_key(obj) -> str:
    """sha256 (first 16 hex digits) of ``obj`` as canonical JSON (sorted keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]
