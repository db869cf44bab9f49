"""Two batch-invariant ``vllm serve`` replicas behind ``ReplicaRouter``: the merged rollout is bit
for bit one server's, and the bitwise loop over both (one publish, both synced through vLLM's HTTP
client) is Δ = 0 on every replica at every step."""
from __future__ import annotations

import numpy as np
import pytest
import requests

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def replicas(qwen_moe_dir, tmp_path_factory):
    from skyrl_numerics.engine.server import VLLMServer

    logs = tmp_path_factory.mktemp("replicas")
    servers = [VLLMServer(qwen_moe_dir, batch_invariant=True, log_path=logs / f"r{i}.log")
               for i in range(2)]
    for s in servers:
        s.start()
    yield [s.url for s in servers]
    for s in servers:
        s.stop()


def test_two_replicas_return_one_servers_bits(replicas):
    from skyrl_numerics.rollout.prompts import make_prompts
    from skyrl_numerics.engine.remote import RemoteGenerator
    from skyrl_numerics.engine.router import ReplicaRouter

    prompts = make_prompts(6, 10, 512, 21)
    kw = dict(temperature=1.0, top_k=16, capture_support=True, max_tokens=8, n=2, seed=3)
    gens = [RemoteGenerator(u) for u in replicas]
    one = gens[0].generate(prompts, **kw)
    router = ReplicaRouter(gens)
    both = router.generate(prompts, **kw)
    assert sorted(set(both.meta["replica"])) == [0, 1]
    assert np.array_equal(both.response_tokens, one.response_tokens)
    assert np.array_equal(both.rollout_logprobs.view(np.uint32), one.rollout_logprobs.view(np.uint32))
    assert both.routes == one.routes and both.support == one.support
    assert [s["url"] for s in both.meta["replicas"]] == replicas
    again = router.generate(prompts, **kw)                 # sticky: each prompt, same replica
    assert again.meta["replica"] == both.meta["replica"]


def test_bitwise_loop_over_two_replicas(replicas, qwen_moe_dir, tmp_path):
    from skyrl_numerics.trainer.loop import CONFIGS, LoopSettings, run_loop

    s = LoopSettings(steps=2, prompts_per_step=4, samples_per_prompt=2, max_tokens=8,
                     measure_grad=False)
    res = run_loop(str(qwen_moe_dir), [CONFIGS["bitwise"]], s, server=replicas, work_dir=tmp_path,
                   progress=False)
    for row in res.history["bitwise"]:
        assert row["gap_max_abs"] == 0.0 and row["gap_frac_bitwise_equal"] == 1.0
        assert row["replica_gap_max_abs"] == [0.0, 0.0]
        assert row["replica_gap_frac_bitwise_equal"] == [1.0, 1.0]
        assert all(t > 0 for t in row["replica_tokens_per_s"])
    for u in replicas:
        assert requests.get(u + "/weight_info", timeout=10).json()["weight_version"] == "2"
