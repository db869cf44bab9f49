"""route_replay with gate weights on tiny HF MoE models built from configs: ``weights="engine"``
(the engine's combine weights forward, straight-through gradient) vs ``"recompute"``, and the
gradient of a replayed expert the trainer's router did not pick."""
import numpy as np
import pytest
import torch

from skyrl_numerics.errors import InputError
from skyrl_numerics.replay import PackedGates, PackedRoutes, record_routes, route_replay
from skyrl_numerics.replay.hf_replay import find_routers

from replay.test_hf_replay import deepseek_v3, qwen3_moe

FAMILIES = {"qwen3_moe": qwen3_moe, "deepseek_v3": deepseek_v3}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return request.param, FAMILIES[request.param]()


def _batch(seed=0, B=2, S=9):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (B, S), generator=g)


def _recorded(model, ids):
    with torch.no_grad(), record_routes(model) as rec:
        model(input_ids=ids)
    lens = [ids.shape[1]] * ids.shape[0]
    return rec.routes(lens), rec.gates(lens, dtype="float32"), rec


def test_engine_weights_equal_to_own_give_identical_logits(family):
    """Gates equal to the trainer's own weights (float32, bit for bit): the forward with
    ``weights="engine"`` is bitwise the ``"recompute"`` one, and so are the gradients."""
    _, model = family
    ids = _batch()
    routes, gates, _ = _recorded(model, ids)
    outs, grads = {}, {}
    for mode in ("recompute", "engine"):
        model.zero_grad()
        with route_replay(model, routes, gates=gates if mode == "engine" else None, weights=mode):
            logits = model(input_ids=ids).logits
        logits.float().pow(2).mean().backward()
        outs[mode] = logits.detach()
        grads[mode] = [r.weight.grad.clone() for _, r in find_routers(model)]
    assert torch.equal(outs["engine"], outs["recompute"])
    for a, b in zip(grads["engine"], grads["recompute"]):
        assert torch.equal(a, b) and a.abs().sum() > 0


def test_engine_weights_are_used_and_router_keeps_gradient(family):
    """Other gate values change the logits (they are used) and the router still gets a gradient
    (straight-through from the recomputed weights)."""
    _, model = family
    ids = _batch(1)
    routes, gates, _ = _recorded(model, ids)
    with torch.no_grad(), route_replay(model, routes):
        ref = model(input_ids=ids).logits
    w = gates.to_float32()
    w[:, -1, :] = w[:, -1, ::-1]         # the last MoE layer's weights swapped between experts
    swapped = PackedGates(w, gates.cu_seqlens, "float32")
    model.zero_grad()
    with route_replay(model, routes, gates=swapped, weights="engine"):
        out = model(input_ids=ids).logits
    out.float().pow(2).mean().backward()
    assert not torch.equal(out.detach(), ref)
    last = find_routers(model)[-1][1]
    assert last.weight.grad is not None and last.weight.grad.abs().sum() > 0


def test_replayed_expert_outside_top_k_gets_gradient(family):
    """The recomputed weights are gathered from the router's full score row: a replayed expert the
    trainer would not pick (not in its top-k) gets a gradient on its router logit, the same under
    "recompute" and "engine" (straight-through)."""
    name, model = family
    ids = _batch(2, B=1, S=6)
    routes, gates, rec = _recorded(model, ids)
    vals = routes.values.copy()
    t, layer = 3, 0
    E = routes.num_experts
    own = set(vals[t, layer].tolist())
    outside = next(e for e in range(E) if e not in own)
    vals[t, layer, 0] = outside
    forced = PackedRoutes(vals, routes.cu_seqlens, E)
    # the engine's weights for the forced ids: the recomputed ones (so both modes run one forward)
    with torch.no_grad(), route_replay(model, forced), record_routes(model) as rec:
        model(input_ids=ids)
    gates = rec.gates([ids.shape[1]], dtype="float32")
    grads = {}
    for mode in ("recompute", "engine"):
        kept = {}

        def keep(module, args, output):
            output[0].retain_grad()
            kept["logits"] = output[0]
        router = find_routers(model)[layer][1]
        h = router.register_forward_hook(keep)   # registered first: sees the router's own output
        model.zero_grad()
        try:
            with route_replay(model, forced, gates=gates if mode == "engine" else None, weights=mode):
                model(input_ids=ids).logits.float().pow(2).mean().backward()
        finally:
            h.remove()
        grads[mode] = kept["logits"].grad[t].float()
    g = grads["recompute"]
    # `outside` is not among the trainer's own top-k (`own`, what its router chose) by construction
    assert g[outside].abs() > 1e-3 * g.abs().max() > 0
    assert torch.equal(grads["engine"], g)
    if name == "deepseek_v3":     # sigmoid scores: only the replayed experts' logits get a gradient
        rest = [e for e in range(E) if e not in set(vals[t, layer].tolist())]
        assert (g[rest] == 0).all()


def test_errors():
    model = qwen3_moe()
    ids = _batch()
    routes, gates, _ = _recorded(model, ids)
    with pytest.raises(InputError, match="needs the engine's gate weights"):
        with route_replay(model, routes, weights="engine"):
            pass
    with pytest.raises(InputError, match="weights='both'"):
        with route_replay(model, routes, gates=gates, weights="both"):
            pass
    short = PackedGates(gates.values[:-1], np.array([0, gates.num_tokens - 1 - 9, gates.num_tokens - 1], np.int32),
                        "float32")
    with pytest.raises(InputError, match="do not match routes"):
        with route_replay(model, routes, gates=short, weights="engine"):
            pass
