"""PackedRoutes through megatron-core 0.16's own RouterReplay, on real TopKRouter modules on CPU.

These tests compute the gating linear on CPU and call the real ``TopKRouter.routing`` (top-k, score function,
group limit, scaling, RouterReplay) with it. Replay inside a whole ``GPTModel.forward`` (via the CPU compatibility
module, with TP 2 x EP 2 and sequence parallelism) is tested in ``tests/trainer/test_megatron_parallel.py``.
"""
import numpy as np
import pytest
import torch

from skyrl_numerics.errors import InputError
from skyrl_numerics.replay import PackedRoutes
from skyrl_numerics.replay.megatron import megatron_record_routes, megatron_replay_indices, megatron_route_replay

pytestmark = pytest.mark.megatron
E, K, H, S, B = 8, 2, 32, 6, 3


@pytest.fixture(scope="module")
def mcore(tmp_path_factory):
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    own = not dist.is_initialized()
    if own:  # file rendezvous: no TCP port to collide with other test processes
        store = tmp_path_factory.mktemp("gloo") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    yield
    ps.destroy_model_parallel()
    if own:
        dist.destroy_process_group()


def _routers(**cfg_kw):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from megatron.core.transformer.transformer_config import TransformerConfig

    RouterReplay.clear_global_router_replay_instances()
    cfg = TransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=4, num_moe_experts=E, moe_router_topk=K,
                            ffn_hidden_size=4 * H, moe_ffn_hidden_size=H,
                            moe_enable_routing_replay=True, use_cpu_initialization=True,
                            moe_router_load_balancing_type="none", add_bias_linear=False, **cfg_kw)
    torch.manual_seed(0)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    routers = [TopKRouter(config=cfg, pg_collection=pgs) for _ in range(2)]
    for r in routers:
        torch.nn.init.normal_(r.weight, std=0.5)
    return routers


def _route(routers, x):
    """Each layer: CPU gating linear + the real TopKRouter.routing; returns [(probs, routing_map, logits)]."""
    out = []
    for r in routers:
        logits = torch.nn.functional.linear(x.reshape(-1, H), r.weight).view(S, B, E)
        probs, rmap = r.routing(logits)
        out.append((probs, rmap, logits.view(-1, E)))
    return out


def _topk_sets(rmap):
    return [set(torch.nonzero(row)[:, 0].tolist()) for row in rmap]


def test_record_then_replay_roundtrip(mcore):
    routers = _routers()
    x = torch.randn(S, B, H)
    lens = [S, S - 2, S - 3]
    with megatron_record_routes() as rec:
        ref = _route(routers, x)
    routes = rec.routes(E, seq_lens=lens, seq_len=S, drop_last=True)
    assert routes.num_layers == 2 and routes.seq_lens.tolist() == [n - 1 for n in lens]
    # recorded = the router's own top-k, in sbhd order (token s*B + b)
    for layer, (_, rmap, _) in enumerate(ref):
        sets = _topk_sets(rmap)
        for b in range(B):
            for s in range(lens[b] - 1):
                assert set(routes.seq(b)[s, layer].tolist()) == sets[s * B + b]
    covered = torch.zeros(S, B, dtype=torch.bool)
    for b in range(B):
        covered[:lens[b] - 1, b] = True
    covered = covered.reshape(-1)
    with megatron_route_replay(routes, seq_len=S):
        again = _route(routers, x)
    for (p0, m0, _), (p1, m1, _) in zip(ref, again):  # covered tokens: bitwise the router's own result
        assert torch.equal(m0[covered], m1[covered]) and torch.equal(p0[covered], p1[covered])
    full = rec.routes(E, seq_lens=[S] * B, seq_len=S)  # full coverage: every token bitwise identical
    with megatron_route_replay(full, seq_len=S):
        again = _route(routers, x)
    for (p0, m0, _), (p1, m1, _) in zip(ref, again):
        assert torch.equal(m0, m1) and torch.equal(p0, p1)


def test_replay_forces_indices_with_trainer_weights_and_gradient(mcore):
    routers = _routers()
    x = torch.randn(S, B, H)
    rng = np.random.default_rng(0)
    lens = [S, S - 1, 2]
    seqs = [np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(2)]) for _ in range(n - 1)])
            for n in lens]
    routes = PackedRoutes.from_sequences(seqs, E)
    with megatron_route_replay(routes, seq_len=S):
        out = _route(routers, x)
    for layer, (probs, rmap, logits) in enumerate(out):
        sets = _topk_sets(rmap)
        for b in range(B):
            for s in range(lens[b] - 1):
                idx = torch.as_tensor(routes.seq(b)[s, layer].astype(np.int64))
                t = s * B + b
                assert sets[t] == set(idx.tolist())
                # softmax after top-k over the trainer's logits at the replayed experts
                want = torch.softmax(logits[t, idx], dim=-1)
                torch.testing.assert_close(probs[t, idx], want)
    sum(p.sum() * (i + 1) for i, (p, _, _) in enumerate(out)).backward()
    for r in routers:
        assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0


def test_sigmoid_group_limited_replay(mcore):
    routers = _routers(moe_router_score_function="sigmoid", moe_router_num_groups=2, moe_router_group_topk=1,
                       moe_router_topk_scaling_factor=2.5)
    x = torch.randn(S, B, H)
    # experts from both groups: a choice group-limited routing itself would never make
    seqs = [np.tile(np.array([[0, 7], [3, 4]]), (S - 1, 1, 1)) for _ in range(B)]
    routes = PackedRoutes.from_sequences(seqs, E)
    with megatron_route_replay(routes, seq_len=S):
        out = _route(routers, x)
    for layer, (probs, rmap, logits) in enumerate(out):
        idx = torch.tensor([[0, 7], [3, 4]][layer])
        for t in range((S - 1) * B):
            assert _topk_sets(rmap)[t] == set(idx.tolist())
            sc = torch.sigmoid(logits[t, idx])
            torch.testing.assert_close(probs[t, idx], sc / (sc.sum() + 1e-20) * 2.5)


def test_index_layouts_and_filler():
    r = PackedRoutes.from_sequences([np.full((2, 1, 2), [1, 2]), np.zeros((0, 1, 2), np.int64),
                                     np.full((1, 1, 2), [5, 6])], 8)
    sb = megatron_replay_indices(r, seq_len=3)[0].view(3, 3, 2)  # [S, B, k]
    assert sb[:, 0].tolist() == [[1, 2], [1, 2], [1, 2]]           # final position: last recorded row
    assert sb[:, 1].tolist() == [[0, 1]] * 3                       # no rows: experts 0..k-1
    assert sb[:, 2].tolist() == [[5, 6]] * 3
    thd = megatron_replay_indices(r, packed_seq_lens=[3, 1, 2])[0]
    assert thd.tolist() == [[1, 2]] * 3 + [[0, 1]] + [[5, 6]] * 2
    with pytest.raises(InputError, match="sequence 0: routes cover 2 positions, the forward has 1"):
        megatron_replay_indices(r, packed_seq_lens=[1, 1, 2])
    with pytest.raises(InputError, match="exactly one of"):
        megatron_replay_indices(r)


def test_errors(mcore):
    _routers()
    r = PackedRoutes.from_sequences([np.zeros((2, 3, K), np.int64)], E)
    with pytest.raises(InputError, match="routes have 3 layers, the model has 2 MoE routers"):
        with megatron_route_replay(r, seq_len=2):
            pass


def test_sequence_parallel_blocks():
    """Under sequence parallelism TP rank r gets tokens [r S/tp, (r+1) S/tp) x B of the sbhd order."""
    rng = np.random.default_rng(1)
    lens = [S, S - 2, 3]
    routes = PackedRoutes.from_sequences(
        [np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(2)]) for _ in range(n)]) for n in lens], E)
    full = megatron_replay_indices(routes, seq_len=S)
    for tp in (2, 3):
        parts = [megatron_replay_indices(routes, seq_len=S, tp_rank=r, tp_size=tp) for r in range(tp)]
        for layer in range(2):
            assert torch.equal(torch.cat([p[layer] for p in parts]), full[layer])
            assert parts[0][layer].shape[0] == S // tp * B
    with pytest.raises(InputError, match="divisible"):
        megatron_replay_indices(routes, seq_len=S, tp_rank=0, tp_size=4)
    with pytest.raises(InputError, match="tp_rank"):
        megatron_replay_indices(routes, seq_len=S, tp_rank=2, tp_size=2)
    with pytest.raises(InputError, match="sbhd"):
        megatron_replay_indices(routes, packed_seq_lens=lens, tp_rank=0, tp_size=2)
