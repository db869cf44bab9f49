"""Sharded delta transfer into a real vLLM CPU engine at tensor parallel 2 (sync/sharded.py).

The trainer side is megatron-core's TP2 x EP2 layout over 4 ranks (``shard_layouts.megatron_layout``,
bitwise what ``megatron/mapping.py`` builds: tests/sync/test_shard_plan.py); each vLLM worker
reads only the links of its own rank and loads them through vLLM's own loaders. Checked: the layout
of the live engine is ``vllm_layout``'s, the weights after a sharded sync are bitwise those after a
full in-place sync, and a refusal on one rank leaves both ranks' weights untouched."""
from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from skyrl_numerics.errors import InputError

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.megatron]


def _digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes(),
                           digest_size=16).hexdigest()


@pytest.fixture(scope="module")
def engine(qwen_moe_dir):
    pytest.importorskip("vllm")
    from skyrl_numerics.engine.generator import VLLMGenerator

    # vLLM CPU binds each TP worker's threads to a NUMA node; one node here: one core per worker
    old = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1" if (os.cpu_count() or 1) >= 2 else "0|0"
    try:
        gen = VLLMGenerator(qwen_moe_dir, tensor_parallel_size=2, distributed_executor_backend="mp",
                            max_model_len=256)
    finally:
        if old is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = old
    yield gen
    gen.close()


@pytest.fixture(scope="module")
def model(qwen_moe_dir):
    from safetensors.torch import load_file

    cfg = json.load(open(os.path.join(qwen_moe_dir, "config.json")))
    hf = {}
    for f in sorted(os.listdir(qwen_moe_dir)):
        if f.endswith(".safetensors"):
            hf.update(load_file(os.path.join(qwen_moe_dir, f)))
    return cfg, hf


def _live(engine) -> list[dict]:
    return engine.llm.collective_rpc("skyrl_weight_digest")


def test_live_engine_layout_is_vllm_layout(engine, model):
    """Every parameter vLLM keeps as loaded is ``vllm_layout``'s tensor, bitwise. Not kept as
    loaded, by host: the MoE stacks (reordered for the CPU MoE kernel) and linear weights vLLM's
    CPU GEMM dispatch packs and then drops (an empty parameter: oneDNN / sgl-kernel hosts drop
    qkv/o and, on some ISAs, the router gate)."""
    from skyrl_numerics.sync import shard_layouts as sl
    from skyrl_numerics.sync import shard_plan as sp

    cfg, hf = model
    want = sp.materialize(sl.vllm_layout(cfg, tp=2), hf)
    live = _live(engine)
    assert len(live) == 2
    empty = _digest(torch.empty(0, dtype=torch.bfloat16))
    for rank, digests in enumerate(live):
        assert set(digests) == set(want[rank]), rank
        same = {n for n, d in digests.items() if d == _digest(want[rank][n])}
        dropped = {n for n, d in digests.items() if d == empty}
        moe = {n for n in digests if ".experts." in n}
        # the embedding (VocabParallelEmbedding keeps its weight) and every norm at least
        assert "model.embed_tokens.weight" in same and "model.norm.weight" in same, rank
        assert all(n in same for n in digests if n.endswith(("layernorm.weight", "q_norm.weight",
                                                              "k_norm.weight"))), rank
        assert all(n in same | dropped for n in digests if n not in moe), \
            (rank, sorted(set(digests) - same - dropped - moe))
        assert dropped <= {n for n in digests if n.endswith(("_proj.weight", "mlp.gate.weight"))}, rank


def _sample(engine) -> tuple:
    """Tokens and logprobs of a seeded sample: they see every weight, also those the host's GEMM
    dispatch packed and dropped (not in the digests)."""
    ro = engine.generate([[3, 17, 42, 9], [5, 6, 7]], n=2, max_tokens=6, seed=3)
    return ro.response_tokens.tolist(), ro.rollout_logprobs.tolist()


def _publish(pub, src, hf, version):
    from skyrl_numerics.sync import shard_plan as sp

    shards = sp.materialize(src, hf)
    for r in pub.ranks():
        pub.publish(r, shards[r])
    pub.seal(version)


def test_sharded_sync_equals_full_sync_and_refusals_switch_no_rank(engine, model, tmp_path):
    from skyrl_numerics.sync import shard_layouts as sl
    from skyrl_numerics.sync import shard_plan as sp
    from skyrl_numerics.engine import sharded_worker as sh
    from skyrl_numerics.sync import sharded as sh_sync
    from skyrl_numerics.engine.weight_update import update_vllm_weights

    cfg, hf0 = model
    src, dst = sl.megatron_layout(cfg, tp=2, ep=2, world=4), sl.vllm_layout(cfg, tp=2)
    plan = sp.plan(src, dst)
    pub = sh_sync.ShardedPublisher(tmp_path, plan)
    g = torch.Generator().manual_seed(7)
    hf1 = {k: (v.float() + 0.01 * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in hf0.items()}

    _publish(pub, src, hf1, 0)
    before = _live(engine)
    out = sh.sharded_update(engine, tmp_path, pub.spec, 0, fill=float("nan"))
    after_sharded, sampled = _live(engine), _sample(engine)
    empty = _digest(torch.empty(0, dtype=torch.bfloat16))     # weights the host's GEMM packed and dropped
    assert all(a[n] != b[n] for a, b in zip(after_sharded, before) for n in a if b[n] != empty)
    update_vllm_weights(engine, hf1)                            # the full in-place sync of the same
    assert _live(engine) == after_sharded                       # bitwise the same weights
    assert _sample(engine) == sampled                           # and the packed ones: same logprobs
    whole = sum(t.numel() * t.element_size() for t in hf1.values())
    assert all(0 < b < whole for b in out["bytes_read"].values()), out

    # a delta: one expert and the final norm change
    hf2 = dict(hf1)
    hf2["model.layers.1.mlp.experts.5.up_proj.weight"] = -hf1["model.layers.1.mlp.experts.5.up_proj.weight"]
    hf2["model.norm.weight"] = hf1["model.norm.weight"] * 2
    _publish(pub, src, hf2, 1)
    out = sh.sharded_update(engine, tmp_path, pub.spec, 1, fill=float("nan"))
    after_sharded, sampled = _live(engine), _sample(engine)
    update_vllm_weights(engine, hf2)
    assert _live(engine) == after_sharded and _sample(engine) == sampled
    assert all(b < 0.2 * whole for b in out["bytes_read"].values()), out

    # a corrupt payload on a link into rank 1: rank 1 refuses, rank 0 prepared but does not switch
    hf3 = {k: -v for k, v in hf2.items()}
    _publish(pub, src, hf3, 2)
    s = next(iter(sh_sync.ShardedReceiver(tmp_path, pub.spec, 1).blocks))
    link = tmp_path / "links" / f"s{s}-d1"
    payload = sorted(p for p in link.rglob("*") if p.is_file() and "manifests" not in p.parts
                     and "000000000002" in str(p))[0]
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0x01
    payload.write_bytes(bytes(data))
    before, sampled = _live(engine), _sample(engine)
    with pytest.raises(InputError, match="engine rank 1 refused version 2.*no rank switched"):
        sh.sharded_update(engine, tmp_path, pub.spec, 2, fill=float("nan"))
    assert _live(engine) == before and _sample(engine) == sampled
    update_vllm_weights(engine, hf0)                            # leave the engine as it was
