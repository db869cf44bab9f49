"""The instance patches of ``engine/vllm_patches.py`` (``INSTANCE_PATCHES``), on real vLLM
objects and without an engine: each replaces one attribute of one object, only when listed, and
its undo puts the very original object back (an attribute the class provided is inherited again).
The class and module patches' install/uninstall: ``tests/e2e/test_server_routes.py``."""
from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

pytest.importorskip("vllm")

from skyrl_numerics.engine import vllm_patches as P  # noqa: E402


@pytest.fixture
def vllm_config():
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


def _rope(head=16):
    from vllm.model_executor.layers.rotary_embedding import get_rope

    return get_rope(head, 64, is_neox_style=False)


def _mla_layer(rope):
    """A ``MultiHeadLatentAttentionWrapper`` holding only its rotary layer (the attribute the
    patch replaces; building a whole one needs an attention backend)."""
    from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper

    m = MultiHeadLatentAttentionWrapper.__new__(MultiHeadLatentAttentionWrapper)
    torch.nn.Module.__init__(m)
    m.rotary_emb = rope
    return m


def test_every_instance_patch_is_listed_with_its_reason():
    doc = P.__doc__
    for what, (cls, attr) in P.INSTANCE_PATCHES.items():
        assert f'``"{what}"``' in doc, what
        assert attr in what or cls is None
        if cls is not None:
            assert cls in doc, cls


def test_sampler_wrap_records_and_undo_restores_the_bound_method():
    from vllm.v1.sample.sampler import Sampler

    sampler = Sampler(logprobs_mode="processed_logprobs")
    tts = sampler.topk_topp_sampler
    original = vars(tts)["forward"]          # vLLM's per-platform pick, an instance attribute
    seen = []
    store = NS(capture=lambda keep, k, p, processed: seen.append((keep, k, p, processed)))
    undo = P.wrap_sampler(NS(sampler=sampler), store)
    assert vars(tts)["forward"] is not original
    assert P.instance_patches() == [("sampler.forward", "TopKTopPSampler")]
    logits = torch.randn(2, 11)
    k = torch.tensor([3, 5])
    sampled, processed = tts.forward(logits.clone(), {}, k, None)
    assert sampled.shape[0] == 2 and len(seen) == 1
    assert seen[0][0] is None and seen[0][3] is processed   # processed mode: no logits copy
    assert torch.isfinite(processed).sum(-1).tolist() == [3, 5]
    undo()
    assert vars(tts)["forward"] is original
    assert P.instance_patches() == []
    undo()                                   # idempotent
    assert vars(tts)["forward"] is original


def test_mla_rowwise_rope_and_undo_restore_the_submodule(vllm_config):
    rope = _rope()
    layers = [_mla_layer(rope), _mla_layer(rope)]
    model = torch.nn.ModuleList(layers + [torch.nn.Linear(2, 2)])
    n, undo = P.rowwise_mla_rope(model)
    assert n == 2
    for m in layers:
        assert isinstance(m.rotary_emb, P._RowwiseRope) and m.rotary_emb.inner is rope
        assert m._modules["rotary_emb"] is m.rotary_emb
    assert P.rowwise_mla_rope(model)[0] == 0   # already fixed: left alone
    assert [w for w, _ in P.instance_patches()] == ["mla.rotary_emb"] * 2
    undo()
    for m in layers:
        assert m.rotary_emb is rope and m._modules["rotary_emb"] is rope
    assert P.instance_patches() == []


def test_model_forward_patch_drops_the_instance_attribute(vllm_config):
    rope = _rope()                           # any vLLM module: its forward comes from the class
    assert "forward" not in vars(rope)
    calls = []

    def timed(*a, **kw):
        calls.append(1)
        return type(rope).forward(rope, *a, **kw)

    undo = P.patch_instance(rope, "forward", timed, what="model.forward")
    assert rope.forward is timed
    undo()
    assert "forward" not in vars(rope)
    assert rope.forward.__func__ is type(rope).forward


def test_unlisted_or_mismatched_patches_are_refused(vllm_config):
    from vllm.v1.sample.sampler import Sampler

    rope = _rope()
    with pytest.raises(KeyError, match="not a listed"):
        P.patch_instance(rope, "forward", None, what="rope.forward")
    with pytest.raises(TypeError, match="MultiHeadLatentAttentionWrapper"):
        P.patch_instance(rope, "rotary_emb", None, what="mla.rotary_emb")
    tts = Sampler().topk_topp_sampler
    with pytest.raises(TypeError, match="sampler.forward.*TopKTopPSampler.forward"):
        P.patch_instance(tts, "logprobs_mode", None, what="sampler.forward")
    assert "forward" not in vars(rope) and P.instance_patches() == []


def test_sampler_digest_hook_sees_the_logits_first_and_undo_restores_the_class_method():
    """The logits digest wraps ``Sampler.forward`` of one sampler: the runner's
    ``self.sampler(logits=..., sampling_metadata=...)`` reaches the store before the original
    runs (a store that raises stops it there); undo removes the instance attribute."""
    from vllm.v1.sample.sampler import Sampler

    sampler = Sampler(logprobs_mode="processed_logprobs")
    assert "forward" not in vars(sampler)

    class Seen(Exception):
        pass

    seen = []

    def capture(logits):
        seen.append(logits)
        raise Seen

    undo = P.wrap_sampler_logits(NS(sampler=sampler), NS(capture=capture))
    assert "forward" in vars(sampler)
    assert P.instance_patches() == [("sampler.digest.forward", "Sampler")]
    x = torch.randn(2, 7)
    with pytest.raises(Seen):
        sampler(logits=x, sampling_metadata=None)
    with pytest.raises(Seen):
        sampler(x, None)
    assert seen[0] is x and seen[1] is x
    undo()
    assert "forward" not in vars(sampler) and sampler.forward.__func__ is Sampler.forward
    assert P.instance_patches() == []
