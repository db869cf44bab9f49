"""Sharded delta transfer without an engine (sync/sharded.py): trainer ranks publish the
blocks of a real megatron layout, engine ranks of a vLLM layout read only their links, and what they
assemble is the full HF tensors at exactly their boxes, bitwise; versions switch all or none.
The real vLLM TP2 engine: tests/e2e/test_sharded_vllm.py."""
from __future__ import annotations

import os

import pytest
import torch

from skyrl_numerics.errors import InputError
from skyrl_numerics.models import tiny_config
from skyrl_numerics.sync import shard_layouts as sl
from skyrl_numerics.sync import shard_plan as sp
from skyrl_numerics.sync import sharded as sh

pytestmark = pytest.mark.megatron


def _cfg(**kw):
    base = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=301)
    base.update(kw)
    return tiny_config("qwen3_moe", **base)


def _hf(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in sl.hf_shapes(cfg).items()}


def _publish(pub, src_layout, hf):
    shards = sp.materialize(src_layout, hf)
    for r in pub.ranks():
        pub.publish(r, shards[r])


def _check_rank(weights, hf, rec: sh.ShardedReceiver):
    got = dict(weights)
    for s, blocks in rec.blocks.items():
        for _, name, box in blocks:
            if name in got:
                sl_ = tuple(slice(a, b) for a, b in box)
                assert torch.equal(got[name][sl_], hf[name][sl_]), (rec.rank, name, box)
    return got


@pytest.fixture()
def setup(tmp_path):
    cfg = _cfg()
    src = sl.megatron_layout(cfg, tp=2, ep=2, world=4)
    dst = sl.vllm_layout(cfg, tp=2)
    plan = sp.plan(src, dst)
    return cfg, src, dst, plan, tmp_path / "store"


def test_versions_reach_every_engine_rank_as_its_boxes(setup):
    cfg, src, dst, plan, root = setup
    pub = sh.ShardedPublisher(root, plan)
    recs = [sh.ShardedReceiver(root, pub.spec, r) for r in range(dst.world)]
    hf0 = _hf(cfg, 0)
    _publish(pub, src, hf0)
    pub.seal(0)
    first = {}
    for rec in recs:
        p = rec.prepare(0)
        first[rec.rank] = p.bytes_read
        got = _check_rank(rec.commit(p), hf0, rec)
        assert set(got) == set(rec.hf_names)              # first version: everything the rank holds
    # version 1 changes one expert's gate and the norm of layer 1: only their vLLM blocks come back
    hf1 = dict(hf0)
    hf1["model.layers.0.mlp.experts.3.gate_proj.weight"] = hf0["model.layers.0.mlp.experts.3.gate_proj.weight"] + 1
    hf1["model.norm.weight"] = hf0["model.norm.weight"] * 2
    _publish(pub, src, hf1)
    pub.seal(1)
    for rec in recs:
        p = rec.prepare(1)
        got = _check_rank(rec.commit(p), hf1, rec)
        assert "model.norm.weight" in got and "model.layers.0.mlp.experts.3.gate_proj.weight" in got
        # vLLM reloads a layer's MLP whole (router and every expert of layer 0), nothing else
        assert all(n.startswith("model.layers.0.mlp.") or n == "model.norm.weight" for n in got), sorted(got)
        assert "model.layers.1.mlp.experts.3.gate_proj.weight" not in got
        assert p.bytes_read < 0.1 * first[rec.rank]       # a delta of two tensors, not a snapshot
    # each rank read only its own links: the link folders it opened are exactly the plan's
    for rec in recs:
        assert {os.path.basename(r.store.root) for r in rec.receivers.values()} == {
            f"s{s}-d{rec.rank}" for s in rec.blocks}


def test_a_refusal_on_one_rank_switches_no_rank(setup):
    cfg, src, dst, plan, root = setup
    pub = sh.ShardedPublisher(root, plan)
    recs = [sh.ShardedReceiver(root, pub.spec, r) for r in range(dst.world)]
    _publish(pub, src, _hf(cfg, 0))
    pub.seal(0)
    for rec in recs:
        rec.commit(rec.prepare(0))
    _publish(pub, src, _hf(cfg, 1))
    # not sealed yet: nobody may read version 1
    with pytest.raises(InputError, match="versions/000000000001.json.*missing"):
        recs[0].prepare(1)
    pub.seal(1)
    # corrupt one payload of a link into rank 1
    s = next(iter(recs[1].blocks))
    link = root / "links" / f"s{s}-d1"
    payload = sorted(p for p in link.rglob("*") if p.is_file() and "manifests" not in str(p)
                     and "000000000001" in str(p))[0]
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0x40
    payload.write_bytes(bytes(data))
    prepared = {}
    errors = {}
    for rec in recs:
        try:
            prepared[rec.rank] = rec.prepare(1)
        except InputError as e:
            errors[rec.rank] = str(e)
    assert set(errors) == {1} and "corrupt" in errors[1]
    assert all(rec.version == 0 for rec in recs)          # nothing committed anywhere


def test_records_and_plans_are_checked(setup, monkeypatch):
    cfg, src, dst, plan, root = setup
    monkeypatch.setenv("SKYRL_NUMERICS_SYNC_KEY", "k1")
    pub = sh.ShardedPublisher(root, plan)
    _publish(pub, src, _hf(cfg, 0))
    with pytest.raises(InputError, match="link s.*not ready"):
        sh.ShardedPublisher(root / "other", plan).seal(0)
    pub.seal(0)
    rec = sh.ShardedReceiver(root, pub.spec, 0)
    # another plan (vLLM EP instead of TP) is refused by digest
    other = sp.plan(src, sl.vllm_layout(cfg, tp=1, dp=2, ep=True))
    with pytest.raises(InputError, match="another plan"):
        sh.ShardedReceiver(root, sh.plan_spec(other), 0).prepare(0)
    # an edited record is refused; a wrong key too
    path = root / "versions" / "000000000000.json"
    good = path.read_bytes()
    path.write_bytes(good.replace(b'"version": 0', b'"version": 0, "x": 1'))
    with pytest.raises(InputError, match="digest mismatch"):
        rec.prepare(0)
    path.write_bytes(good)
    monkeypatch.setenv("SKYRL_NUMERICS_SYNC_KEY", "k2")
    with pytest.raises(InputError, match="signature"):
        sh.ShardedReceiver(root, pub.spec, 0).prepare(0)
    monkeypatch.setenv("SKYRL_NUMERICS_SYNC_KEY", "k1")
    rec.commit(rec.prepare(0))
    with pytest.raises(InputError, match="holds no tensor"):
        pub.publish(0, {})


def test_engine_ranks_read_less_than_a_full_sync(setup):
    """Bytes each engine rank reads (compressed payloads of its links) against one full-state delta
    stream every rank would read whole."""
    from skyrl_numerics.sync.weight_sync import DeltaPublisher

    cfg, src, dst, plan, root = setup
    pub = sh.ShardedPublisher(root, plan)
    recs = [sh.ShardedReceiver(root, pub.spec, r) for r in range(dst.world)]
    hf = _hf(cfg, 0)
    _publish(pub, src, hf)
    pub.seal(0)
    full = DeltaPublisher(root / "full").publish(hf)
    whole = sum(e.payload_nbytes for e in full.tensors)
    for rec in recs:
        assert rec.prepare(0).bytes_read < 0.75 * whole


def test_any_edit_of_the_version_record_is_refused(setup):
    """Flip any bit of the sealed record: the engine rank refuses it, unless the edit left the
    parsed record the same (white space) — then it is the same version."""
    import json

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    cfg, src, dst, plan, root = setup
    pub = sh.ShardedPublisher(root, plan)
    _publish(pub, src, _hf(cfg, 0))
    pub.seal(0)
    path = root / "versions" / "000000000000.json"
    good = path.read_bytes()

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(pos=st.integers(0, len(good) - 1), bit=st.integers(0, 7))
    def flip(pos, bit):
        bad = bytearray(good)
        bad[pos] ^= 1 << bit
        path.write_bytes(bytes(bad))
        try:
            same = json.loads(bytes(bad)) == json.loads(good)
        except ValueError:
            same = False
        try:
            sh.ShardedReceiver(root, pub.spec, 1).prepare(0)
            assert same, (pos, bit)
        except InputError:
            assert not same, (pos, bit)
        finally:
            path.write_bytes(good)

    flip()
