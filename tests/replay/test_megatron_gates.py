"""megatron_route_replay(weights="engine"): the engine's combine weights in real megatron-core
TopKRouter.routing on CPU (the gating linear on CPU, as tests/replay/test_megatron.py)."""
import numpy as np
import pytest
import torch

from skyrl_numerics.errors import InputError
from skyrl_numerics.replay import PackedGates, PackedRoutes
from skyrl_numerics.replay.megatron import megatron_route_replay

import replay.test_megatron as tm
from replay.test_megatron import B, E, H, K, S, _route, _routers

mcore = tm.mcore   # the module's gloo + model-parallel fixture
pytestmark = [pytest.mark.megatron, pytest.mark.usefixtures("mcore")]


def _routes_and_gates(lens, seed=0):
    rng = np.random.default_rng(seed)
    ids = [np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(2)]) for _ in range(n - 1)])
           for n in lens]
    w = [rng.uniform(0.05, 1.0, size=(n - 1, 2, K)).astype(np.float32) for n in lens]
    return PackedRoutes.from_sequences(ids, E), PackedGates.from_sequences(w, "float32")


@pytest.mark.parametrize("cfg", [{}, dict(moe_router_score_function="sigmoid", moe_router_num_groups=2,
                                          moe_router_group_topk=1, moe_router_topk_scaling_factor=2.5)])
def test_engine_weights_in_megatron_routing(cfg):
    routers = _routers(**cfg)
    x = torch.randn(S, B, H)
    lens = [S, S - 1, 2]
    routes, gates = _routes_and_gates(lens)
    with megatron_route_replay(routes, seq_len=S):
        ref = _route(routers, x)
    for r in routers:
        r.zero_grad()
    with megatron_route_replay(routes, seq_len=S, gates=gates, weights="engine", routers=routers):
        out = _route(routers, x)
    assert all("routing" not in r.__dict__ for r in routers)   # unwrapped on exit
    w = gates.to_float32()
    for layer, ((p, m, _), (p0, m0, _)) in enumerate(zip(out, ref)):
        assert torch.equal(m, m0)
        for b in range(B):
            for s in range(S):
                t = s * B + b
                if s < lens[b] - 1:       # covered: the engine's weights at its experts, bit for bit
                    row = routes.cu_seqlens[b] + s
                    idx = torch.as_tensor(routes.values[row, layer].astype(np.int64))
                    assert torch.equal(p[t, idx], torch.from_numpy(w[row, layer]).to(p.dtype))
                    assert (p[t][~m[t]] == 0).all()
    # straight-through: the gradient is the recomputed probs' one
    sum(p.sum() * (i + 1) for i, (p, _, _) in enumerate(out)).backward()
    g_engine = [r.weight.grad.clone() for r in routers]
    for r in routers:
        r.zero_grad()
    with megatron_route_replay(routes, seq_len=S):
        again = _route(routers, x)
    sum(p.sum() * (i + 1) for i, (p, _, _) in enumerate(again)).backward()
    for ge, r in zip(g_engine, routers):
        assert ge.abs().sum() > 0 and torch.equal(ge, r.weight.grad)


def test_engine_weights_need_gates_and_routers():
    routers = _routers()
    routes, gates = _routes_and_gates([S, S, S])
    with pytest.raises(InputError, match="needs the engine's gate weights"):
        with megatron_route_replay(routes, seq_len=S, weights="engine", routers=routers):
            pass
    with pytest.raises(InputError, match="TopKRouter modules"):
        with megatron_route_replay(routes, seq_len=S, gates=gates, weights="engine"):
            pass
