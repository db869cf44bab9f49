"""ReplicaRouter without engines: sticky sessions, least-loaded placement, per-prompt seeds kept,
and the merged rollout equal to what one replica returns (replicas here are deterministic fakes:
a response is a function of the prompt and its seed only, as a batch-invariant engine's is)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl_numerics.errors import InputError
from skyrl_numerics.rollout import Rollout
from skyrl_numerics.engine.router import ReplicaRouter


class Fake:
    def __init__(self, name):
        self.url, self.calls = name, []

    def generate(self, prompts, *, seeds=None, max_tokens=4, n=1, **kw):
        self.calls.append(len(prompts))
        P, R, L = [], [], []
        for p, s in zip(prompts, seeds):
            for j in range(n):
                rng = np.random.default_rng([s, j, *p])
                R.append(list(rng.integers(0, 100, max_tokens)))
                L.append(list(-rng.random(max_tokens).astype(np.float32)))
                P.append(list(p))
        extra = {}
        if kw.get("gate_weights"):   # routes + combine weights, a function of prompt and seed
            from skyrl_numerics.replay import PackedGates, PackedRoutes

            rngs = [np.random.default_rng([s, j, 7, *p]) for p, s in zip(prompts, seeds) for j in range(n)]
            lens = [len(p) + len(r) - 1 for p, r in zip(P, R)]
            extra["routes"] = PackedRoutes.from_sequences([g.integers(0, 8, (m, 2, 2)) for g, m in zip(rngs, lens)], 8)
            extra["gates"] = PackedGates.from_sequences([g.random((m, 2, 2)).astype(np.float32)
                                                         for g, m in zip(rngs, lens)])
        ro = Rollout.from_lists(P, R, L, group_ids=np.repeat(np.arange(len(prompts)), n),
                                engine="fake", **extra)
        from skyrl_numerics.gap.topk import TopkLogprobs

        ro.topk = TopkLogprobs(np.asarray(ro.response_tokens)[:, None].repeat(2, 1),
                               np.asarray(ro.rollout_logprobs)[:, None].repeat(2, 1))
        from skyrl_numerics.gap.digest import LogitsDigests, row_digests

        rows = np.stack([ro.response_tokens, ro.rollout_logprobs], 1).astype(np.float32)
        ro.logits_digest = LogitsDigests(row_digests(rows, "blake2b-128"), "blake2b-128")
        return ro


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=5), min_size=1, max_size=9),
       st.integers(1, 4), st.integers(1, 3), st.integers(0, 1000))
def test_merged_rollout_equals_one_replica(prompts, replicas, n, seed):
    one = ReplicaRouter([Fake("a")]).generate(prompts, seed=seed, n=n, max_tokens=3)
    many = ReplicaRouter([Fake(str(i)) for i in range(replicas)])
    got = many.generate(prompts, seed=seed, n=n, max_tokens=3)
    assert np.array_equal(got.prompt_tokens, one.prompt_tokens)
    assert np.array_equal(got.response_tokens, one.response_tokens)
    assert np.array_equal(got.rollout_logprobs.view(np.uint32), one.rollout_logprobs.view(np.uint32))
    assert np.array_equal(got.group_ids, np.repeat(np.arange(len(prompts)), n))
    assert np.array_equal(got.topk.ids, one.topk.ids)
    assert np.array_equal(got.topk.values.view(np.uint32), one.topk.values.view(np.uint32))
    assert np.array_equal(got.logits_digest.digests, one.logits_digest.digests)
    assert got.logits_digest.algo == "blake2b-128"
    assert len(got.meta["replica"]) == len(prompts) * n
    distinct = len({tuple(p) for p in prompts})
    assert len(got.meta["replicas"]) == min(replicas, distinct)


@settings(max_examples=10, deadline=None)
@given(st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=5), min_size=1, max_size=6),
       st.integers(2, 3), st.integers(1, 2))
def test_merged_gate_weights_equal_one_replica(prompts, replicas, n):
    one = ReplicaRouter([Fake("a")]).generate(prompts, seed=3, n=n, max_tokens=3, gate_weights=True)
    got = ReplicaRouter([Fake(str(i)) for i in range(replicas)]).generate(
        prompts, seed=3, n=n, max_tokens=3, gate_weights=True)
    assert got.routes == one.routes and got.gates == one.gates


def test_sticky_and_least_loaded():
    fakes = [Fake("a"), Fake("b"), Fake("c")]
    r = ReplicaRouter(fakes)
    assert [r.place(s, 10) for s in ("x", "y", "z")] == [0, 1, 2]
    assert r.place("x", 10) == 0              # sticky, although replica 0 is now the busiest
    assert r.place("w", 1) == 1               # least loaded: b (10) and c (10) tie -> lowest
    ro = r.generate([[1, 2], [3]], sessions=["z", "x"], seed=5)
    assert ro.meta["replica"] == [2, 0]
    with pytest.raises(InputError, match="2 sessions for 1 prompts"):
        r.generate([[1]], sessions=["a", "b"])
    with pytest.raises(InputError, match="no replicas"):
        ReplicaRouter([])
