"""``hf_config.moe_dims``: one reading of the MoE fields of every family's config, whether a
``config.json`` dict or a transformers config object (attribute maps included). No downloads:
configs are built with transformers' own config classes."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

from skyrl_numerics.hf_config import NUM_EXPERTS_KEYS, MoEDims, moe_dims, moe_layout


def _classes():
    import transformers as tf

    # family -> (config class, kwargs in the family's own field names, what moe_dims must read)
    return {
        "qwen3_moe": (tf.Qwen3MoeConfig, dict(num_experts=12, num_experts_per_tok=3, moe_intermediate_size=40,
                                              num_hidden_layers=5, mlp_only_layers=[1], decoder_sparse_step=1),
                      dict(num_experts=12, top_k=3, moe_intermediate=40, n_shared=0, moe_layers=[0, 2, 3, 4])),
        "deepseek_v3": (tf.DeepseekV3Config, dict(n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=24,
                                                  n_shared_experts=2, first_k_dense_replace=2, num_hidden_layers=4),
                        dict(num_experts=16, top_k=4, moe_intermediate=24, n_shared=2, moe_layers=[2, 3])),
        "mixtral": (tf.MixtralConfig, dict(num_local_experts=6, num_experts_per_tok=2, intermediate_size=56,
                                           num_hidden_layers=3),
                    dict(num_experts=6, top_k=2, moe_intermediate=56, n_shared=0, moe_layers=[0, 1, 2])),
        "gpt_oss": (tf.GptOssConfig, dict(num_local_experts=32, num_experts_per_tok=4, intermediate_size=72,
                                          num_hidden_layers=2),
                    dict(num_experts=32, top_k=4, moe_intermediate=72, n_shared=0, moe_layers=[0, 1])),
        "glm4_moe": (tf.Glm4MoeConfig, dict(n_routed_experts=20, num_experts_per_tok=5, moe_intermediate_size=16,
                                            n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=3),
                     dict(num_experts=20, top_k=5, moe_intermediate=16, n_shared=1, moe_layers=[1, 2])),
    }


FAMILIES = ("qwen3_moe", "deepseek_v3", "mixtral", "gpt_oss", "glm4_moe")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("form", ["object", "to_dict", "namespace"])
def test_every_family_reads_the_same_dims(family, form):
    cls, kw, want = _classes()[family]
    cfg = cls(**kw)
    src = {"object": cfg, "to_dict": cfg.to_dict(), "namespace": SimpleNamespace(**cfg.to_dict())}[form]
    d = moe_dims(src)
    got = dict(num_experts=d.num_experts, top_k=d.top_k, moe_intermediate=d.moe_intermediate,
               n_shared=d.n_shared, moe_layers=d.moe_layers())
    assert got == want
    assert moe_layout(src) == (want["num_experts"], want["moe_layers"])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_multimodal_text_config_is_read(family):
    cls, kw, want = _classes()[family]
    outer = {"architectures": ["SomeVLM"], "text_config": cls(**kw).to_dict(), "vision_config": {}}
    assert moe_dims(outer).num_experts == want["num_experts"]


def test_dense_configs_have_no_experts():
    import transformers as tf

    for cfg in (tf.LlamaConfig(num_hidden_layers=3).to_dict(), {"num_hidden_layers": 2, "num_experts": 0},
                {"num_experts": None, "num_local_experts": True}):
        d = moe_dims(cfg)
        assert d.num_experts == 0 and not d.is_moe and d.moe_layers() == []
        assert moe_layout(cfg) is None


def test_nemotron_h_moe_layers_are_its_moe_blocks():
    """Nemotron-H's config class stores ``n_routed_experts`` (8) by default: without ``moe``
    blocks the model is dense; with them, those blocks are its MoE layers."""
    import transformers as tf

    kw = dict(layers_block_type=["linear_attention", "full_attention", "mlp"])
    dense = tf.NemotronHConfig(**kw).to_dict()
    assert dense["n_routed_experts"] > 0 and moe_layout(dense) is None
    moe = tf.NemotronHConfig(layers_block_type=["linear_attention", "moe", "full_attention", "moe"])
    assert moe_layout(moe.to_dict()) == (moe.n_routed_experts, [1, 3])


@settings(max_examples=80, deadline=None)
@given(values=st.lists(st.one_of(st.none(), st.integers(-2, 300), st.booleans(), st.just("8")),
                       min_size=len(NUM_EXPERTS_KEYS), max_size=len(NUM_EXPERTS_KEYS)))
def test_one_precedence_order(values):
    """The expert count is the first key of NUM_EXPERTS_KEYS with a positive int, whatever else
    the config holds (bools and strings are not counts)."""
    cfg = {k: v for k, v in zip(NUM_EXPERTS_KEYS, values)}
    ok = [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    assert moe_dims(cfg).num_experts == (ok[0] if ok else 0)
    assert moe_dims(SimpleNamespace(**cfg)).num_experts == moe_dims(cfg).num_experts


@settings(max_examples=80, deadline=None)
@given(layers=st.integers(1, 12), first=st.integers(0, 4), freq=st.integers(1, 3), step=st.integers(1, 3),
       skip=st.sets(st.integers(0, 11), max_size=3))
def test_moe_layers_follow_each_familys_rule(layers, first, freq, step, skip):
    d = MoEDims(num_experts=4, top_k=2, first_dense=first, layer_freq=freq, sparse_step=step,
                dense_layers=tuple(skip), num_layers=layers)
    want = [i for i in range(layers) if i >= first and i % freq == 0 and i not in skip
            and (i + 1) % step == 0]
    assert d.moe_layers() == want


def test_the_readers_agree_on_the_tiny_models(qwen_moe_dir, deepseek_v3_dir):
    """The doctor's checkpoint check, the sharded-sync layouts, the megatron config and the
    invariant families read the same expert count from the same config.json."""
    import json

    from skyrl_numerics.doctor.model_check import inspect_checkpoint
    from skyrl_numerics.invariant import family_class
    from skyrl_numerics.sync.shard_layouts import hf_shapes
    from skyrl_numerics.trainer.megatron.model import hf_config_dict

    for d in (qwen_moe_dir, deepseek_v3_dir):
        cfg = json.loads((d / "config.json").read_text())
        e = moe_dims(cfg).num_experts
        assert e == 8
        assert inspect_checkpoint(d, count_params=False).num_experts == e
        assert hf_config_dict(cfg)["num_experts"] == e
        dims = family_class(cfg["architectures"][0]).config_parts(SimpleNamespace(**cfg))["dims"]
        assert dims.experts == e
        shapes = hf_shapes(cfg)
        assert max(int(n.split(".experts.")[1].split(".")[0]) for n in shapes if ".mlp.experts." in n) == e - 1


def test_nemotron_h_hybrid_override_pattern_is_read():
    """NVIDIA's ``config.json`` names the blocks with ``hybrid_override_pattern`` letters (``M``
    Mamba-2, ``E`` MoE, ``*`` attention, ``-`` MLP) and no ``layers_block_type``: read as
    transformers reads it (Nemotron 3 Nano's pattern starts ``MEMEM*E``)."""
    from skyrl_numerics.hf_config import nemotron_block_types

    cfg = {"model_type": "nemotron_h", "hybrid_override_pattern": "MEMEM*E", "num_hidden_layers": 7,
           "n_routed_experts": 128, "num_experts_per_tok": 6, "moe_intermediate_size": 1856,
           "n_shared_experts": 1}
    assert nemotron_block_types(cfg)[:3] == ["linear_attention", "moe", "linear_attention"]
    d = moe_dims(cfg)
    assert (d.num_experts, d.top_k, d.moe_intermediate, d.n_shared) == (128, 6, 1856, 1)
    assert moe_layout(cfg) == (128, [1, 3, 6])
    assert moe_layout({**cfg, "hybrid_override_pattern": "M-M*M-M"}) is None
    assert nemotron_block_types({"hybrid_override_pattern": "MX"}) is None
