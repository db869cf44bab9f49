"""hashing.py: the one place the digests and cache keys are computed."""
from __future__ import annotations

import hashlib
import json

import pytest

from skyrl_numerics import hashing
from skyrl_numerics.errors import InputError


def test_json_key_is_sha256_of_canonical_json():
    obj = {"b": [1, 2.5], "a": {"z": None, "y": "s"}}
    want = hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]
    assert hashing.json_key(obj) == want == hashing.json_key(dict(reversed(obj.items())))


def test_digest_algorithms():
    assert hashing.default_algo() in hashing.DIGEST_ALGOS
    h = hashing.hasher("blake2b-128")
    h.update(b"abc")
    assert h.hexdigest() == hashlib.blake2b(b"abc", digest_size=16).hexdigest()
    with pytest.raises(InputError, match="unknown digest algorithm 'md5'"):
        hashing.hasher("md5")
