"""A megatron-core 0.16.1 ``GPTModel`` built from an HF Qwen3-MoE, DeepSeek-V3, Mixtral or dense
(Qwen3, Llama, Qwen2, Mistral) config, with TP / EP.

Layout: ``tensor_model_parallel_size = tp`` for attention, embedding and lm-head;
``expert_model_parallel_size = ep`` with ``expert_tensor_parallel_size = 1`` (whole experts per rank), so
``tp * ep`` ranks can share the same processes (world size ``max(tp, ep)`` with TP and EP over the same
ranks, e.g. TP 2 and EP 2 on 2 processes). With ``tp > 1`` sequence parallelism is on (megatron-core needs
it with MoE and TP): the decoder's hidden states are split along the sequence over the TP ranks.

Qwen3-MoE in megatron-core terms: RMSNorm, per-head q/k RMSNorm (``qk_layernorm``), GQA
(``num_query_groups``), RoPE (non-interleaved = HF's rotate_half), SwiGLU experts (``gated_linear_unit``),
softmax router with top-k then renormalize (``moe_router_pre_softmax=False`` — the same as HF's
``norm_topk_prob=True``: softmax over all experts, top-k, divide by their sum), no biases, untied lm-head.
Mixtral is the same without the q/k norm (its router: softmax over all experts, top-k, renormalized,
the same ``moe_router_pre_softmax=False``). The dense decoders have one SwiGLU MLP per layer
(``num_moe_experts=None``): Qwen3 with q/k norm, Qwen2 with q/k/v biases (``add_qkv_bias``), Llama and
Mistral plain. What megatron-core's GPT layer cannot express is refused by :func:`check_parallel_config`
naming the field (:func:`unsupported_field`): a RoPE scaling type other than the default, a sliding
window shorter than the context, Llama's / Qwen3's ``attention_bias`` (it also biases ``o_proj``),
an activation other than SiLU, Mixtral's router jitter, ``tp > 1`` for the dense decoders (their MLP's
TP layout is not mapped).
Local (non-Transformer-Engine) layer spec; experts are ``SequentialMLP`` (one ColumnParallel/RowParallel
MLP per expert) or, with ``grouped_experts=True``, the legacy ``GroupedMLP`` (``weight1``/``weight2``;
megatron-core requires ``bf16`` for it).

:func:`check_parallel_config` validates the layout against the model config and raises
:class:`~skyrl_numerics.errors.InputError` naming the field; call it before any process group starts
(:func:`skyrl_numerics.trainer.megatron.trainer.spawn_megatron` does).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from skyrl_numerics.errors import InputError
from skyrl_numerics.hf_config import moe_dims

__all__ = ["ParallelConfig", "hf_config_dict", "check_parallel_config", "transformer_config", "init_parallel",
           "build_gpt_model", "destroy_parallel", "tp_group", "tp_rank_size"]

SUPPORTED = ("qwen3_moe", "deepseek_v3", "mixtral", "qwen3", "llama", "qwen2", "mistral")
#: one SwiGLU MLP per layer, no experts
DENSE = ("qwen3", "llama", "qwen2", "mistral")
#: per-head q/k RMSNorm
QK_NORM = ("qwen3_moe", "qwen3")


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1   # tensor parallel (attention heads, vocabulary)
    ep: int = 1   # expert parallel (whole experts per rank)

    @property
    def world_size(self) -> int:
        return max(self.tp, self.ep)


def _normalized(cfg: dict) -> dict:
    cfg = dict(cfg)
    experts = moe_dims(cfg).num_experts    # under whichever name the config stores it
    if experts:
        cfg["num_experts"] = experts
    if cfg.get("model_type") == "deepseek_v3":  # MLA: no KV groups
        cfg["num_key_value_heads"] = cfg.get("num_attention_heads")
    if cfg.get("rope_theta") is None:
        cfg["rope_theta"] = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return cfg


def hf_config_dict(config) -> dict:
    """An HF model config as a dict: a model directory, a ``config.json`` path, a dict or a PretrainedConfig."""
    return _normalized(_raw_config(config))


def _raw_config(config) -> dict:
    if isinstance(config, dict):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        p = Path(config)
        p = p / "config.json" if p.is_dir() else p
        if not p.is_file():
            raise InputError(f"{p}: no such config file", field="config")
        try:
            return json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise InputError(f"{p}: not JSON ({e})", field="config") from None
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise InputError(f"cannot read a model config from {type(config).__name__}", field="config")


def _int(cfg: dict, key: str) -> int:
    v = cfg.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise InputError(f"model config field {key!r} must be a positive int, got {v!r}", field=key)
    return v


def check_parallel_config(config, tp: int = 1, ep: int = 1, *, world_size: int | None = None) -> dict:
    """Raise InputError unless ``tp`` / ``ep`` fit the model (and ``world_size``); returns the config dict.

    TP must divide the attention heads, the KV heads (query groups) and the vocabulary; EP must divide the
    experts; the world size must be ``max(tp, ep)`` with the smaller dividing the larger.
    """
    cfg = hf_config_dict(config)
    mt = cfg.get("model_type")
    if mt not in SUPPORTED:
        raise InputError(f"model_type {mt!r} is not supported by the megatron trainer (supported: {SUPPORTED})",
                         field="model_type")
    for name, v in (("tp", tp), ("ep", ep)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise InputError(f"{name} must be a positive int, got {v!r}", field=name)
    bad = unsupported_field(cfg)
    if bad is not None:
        raise InputError(f"{mt}: {bad[1]}: the megatron trainer cannot reproduce it", field=bad[0])
    heads, kv = _int(cfg, "num_attention_heads"), _int(cfg, "num_key_value_heads")
    vocab = _int(cfg, "vocab_size")
    if mt in DENSE:
        return _check_dense(cfg, heads, kv, vocab, tp, ep, world_size)
    experts, k = _int(cfg, "num_experts"), _int(cfg, "num_experts_per_tok")
    if heads % tp:
        raise InputError(f"tp={tp} does not divide num_attention_heads={heads}", field="tp")
    if kv % tp:
        raise InputError(f"tp={tp} does not divide num_key_value_heads={kv} (query groups)", field="tp")
    if vocab % tp:
        raise InputError(f"tp={tp} does not divide vocab_size={vocab}", field="tp")
    if experts % ep:
        raise InputError(f"ep={ep} does not divide num_experts={experts}", field="ep")
    if k > experts:
        raise InputError(f"num_experts_per_tok={k} > num_experts={experts}", field="num_experts_per_tok")
    if max(tp, ep) % min(tp, ep):
        raise InputError(f"tp={tp} and ep={ep}: the smaller must divide the larger", field="ep")
    if mt == "deepseek_v3":
        if tp > 1:
            raise InputError("DeepSeek-V3 (MLA) is mapped for tp=1 only (EP > 1 is fine)", field="tp")
        if cfg.get("rope_scaling") or (cfg.get("rope_parameters") or {}).get("rope_type", "default") != "default":
            raise InputError("DeepSeek-V3 with YaRN RoPE scaling is not mapped (megatron's yarn rope is not "
                             "checked against HF here)", field="rope_scaling")
        if cfg.get("topk_method", "noaux_tc") != "noaux_tc" or cfg.get("scoring_func", "sigmoid") != "sigmoid":
            raise InputError("DeepSeek-V3 routing must be sigmoid + noaux_tc", field="topk_method")
        if int(cfg.get("moe_layer_freq", 1) or 1) != 1:
            raise InputError("moe_layer_freq != 1 is not mapped", field="moe_layer_freq")
    elif cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1) or 1) != 1:
        raise InputError("dense (mlp_only) layers are not mapped yet: every layer must be MoE",
                         field="mlp_only_layers")
    if cfg.get("tie_word_embeddings"):
        raise InputError("tied embeddings are not supported (the tiny Qwen3-MoE is untied)",
                         field="tie_word_embeddings")
    if world_size is not None and world_size != max(tp, ep):
        raise InputError(f"world_size={world_size}, but tp={tp} / ep={ep} need {max(tp, ep)} ranks",
                         field="world_size")
    return cfg


def _check_dense(cfg: dict, heads: int, kv: int, vocab: int, tp: int, ep: int, world_size) -> dict:
    if tp > 1:
        raise InputError(f"{cfg['model_type']}: the dense MLP's tensor-parallel layout is not mapped "
                         "(tp=1 only)", field="tp")
    if ep > 1:
        raise InputError(f"{cfg['model_type']} is dense: no experts to split over ep={ep}", field="ep")
    if cfg.get("tie_word_embeddings"):
        raise InputError("tied embeddings are not supported", field="tie_word_embeddings")
    if world_size is not None and world_size != 1:
        raise InputError(f"world_size={world_size}, but tp=1 / ep=1 need 1 rank", field="world_size")
    return cfg


def unsupported_field(cfg: dict) -> tuple[str, str] | None:
    """``(field, what)`` of the first setting of a Mixtral or dense config that megatron-core's GPT
    layer (as built here) would not reproduce, or None. Each would otherwise train a different
    model than the engine serves, silently."""
    mt = cfg.get("model_type")
    if mt not in DENSE and mt != "mixtral":
        return None
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return "rope_parameters", f"RoPE type {rope.get('rope_type', rope.get('type'))!r} (only 'default')"
    if float(rope.get("partial_rotary_factor", 1.0) or 1.0) != 1.0:
        return "partial_rotary_factor", "partial RoPE"
    window = cfg.get("sliding_window")
    if mt == "qwen2" and not cfg.get("use_sliding_window"):
        window = None                      # Qwen2 reads the window only with use_sliding_window
    if window is not None and int(window) < int(cfg.get("max_position_embeddings") or 0):
        return "sliding_window", f"a sliding window of {window} shorter than the context"
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        return "hidden_act", f"activation {act!r} (only SwiGLU with 'silu')"
    if mt in ("llama", "qwen3") and cfg.get("attention_bias"):
        return "attention_bias", "attention biases (q/k/v and o_proj)"
    if mt == "llama" and cfg.get("mlp_bias"):
        return "mlp_bias", "MLP biases"
    if mt == "mixtral" and float(cfg.get("router_jitter_noise") or 0.0) != 0.0:
        return "router_jitter_noise", "router jitter noise"
    return None


def transformer_config(config, *, tp: int = 1, ep: int = 1, dtype: torch.dtype = torch.float32,
                       grouped_experts: bool = False, route_replay: bool = True):
    """The megatron-core ``TransformerConfig`` of an HF config (fusions off: they need CUDA)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = check_parallel_config(config, tp, ep)
    H = cfg["hidden_size"]
    if cfg["model_type"] == "deepseek_v3":
        return _mla_config(cfg, tp=tp, ep=ep, dtype=dtype, grouped_experts=grouped_experts, route_replay=route_replay)
    mt = cfg["model_type"]
    if mt in DENSE:
        moe = {}
    else:   # Mixtral's expert width is its intermediate_size; softmax, top-k, renormalized
        moe = dict(moe_ffn_hidden_size=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
                   num_moe_experts=cfg["num_experts"], moe_router_topk=cfg["num_experts_per_tok"],
                   moe_router_pre_softmax=mt != "mixtral" and not cfg.get("norm_topk_prob", True),
                   moe_router_score_function="softmax", moe_router_load_balancing_type="none",
                   moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=grouped_experts,
                   moe_enable_routing_replay=route_replay, moe_permute_fusion=False)
    return TransformerConfig(
        num_layers=cfg["num_hidden_layers"], hidden_size=H, num_attention_heads=cfg["num_attention_heads"],
        num_query_groups=cfg["num_key_value_heads"], kv_channels=cfg.get("head_dim") or H // cfg["num_attention_heads"],
        ffn_hidden_size=cfg.get("intermediate_size", 4 * H), **moe,
        normalization="RMSNorm", layernorm_epsilon=cfg.get("rms_norm_eps", 1e-6), qk_layernorm=mt in QK_NORM,
        add_bias_linear=False, add_qkv_bias=mt == "qwen2" or bool(cfg.get("attention_bias", False)),
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
        sequence_parallel=tp > 1, params_dtype=dtype, bf16=dtype == torch.bfloat16 or grouped_experts,
        use_cpu_initialization=True, perform_initialization=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, cross_entropy_loss_fusion=False,
    )


def _mla_config(cfg, *, tp, ep, dtype, grouped_experts, route_replay):
    """DeepSeek-V3: MLA (q/kv LoRA, decoupled RoPE), sigmoid router with expert bias and group-limited top-k,
    scaled renormalized weights, one shared expert block, the first ``first_k_dense_replace`` layers dense.

    megatron's MLA always de-interleaves the rope channels before its rotate-half RoPE, which is HF's
    ``rope_interleave=True``; for ``rope_interleave=False`` :mod:`.mapping` pre-permutes those weight rows."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    L, k = cfg["num_hidden_layers"], int(cfg.get("first_k_dense_replace", 0) or 0)
    return MLATransformerConfig(
        num_layers=L, hidden_size=cfg["hidden_size"], num_attention_heads=cfg["num_attention_heads"],
        ffn_hidden_size=cfg["intermediate_size"], moe_ffn_hidden_size=cfg["moe_intermediate_size"],
        num_moe_experts=cfg["num_experts"], moe_router_topk=cfg["num_experts_per_tok"],
        moe_shared_expert_intermediate_size=(cfg.get("n_shared_experts") or 0) * cfg["moe_intermediate_size"] or None,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_dtype="fp32",
        moe_router_num_groups=cfg.get("n_group"), moe_router_group_topk=cfg.get("topk_group"),
        moe_router_topk_scaling_factor=cfg.get("routed_scaling_factor", 1.0), moe_router_bias_update_rate=0.0,
        moe_layer_freq=[0] * k + [1] * (L - k), moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall", moe_grouped_gemm=grouped_experts, moe_enable_routing_replay=route_replay,
        moe_permute_fusion=False,
        q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"], qk_head_dim=cfg["qk_nope_head_dim"],
        qk_pos_emb_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"], rope_type="rope",
        rotary_base=cfg["rope_theta"], qk_layernorm=True,
        normalization="RMSNorm", layernorm_epsilon=cfg.get("rms_norm_eps", 1e-6), add_bias_linear=False,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
        sequence_parallel=tp > 1, params_dtype=dtype, bf16=dtype == torch.bfloat16 or grouped_experts,
        use_cpu_initialization=True, perform_initialization=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, cross_entropy_loss_fusion=False,
    )


def init_parallel(tp: int = 1, ep: int = 1, *, seed: int = 0) -> None:
    """megatron-core's model-parallel groups on the default process group (which must exist), + RNG tracker."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        raise InputError("init_parallel needs the default process group (dist.init_process_group)", field="dist")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=1)
    model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()


def tp_group():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group()


def tp_rank_size() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


class RMSNorm(torch.nn.Module):
    """HF Qwen3's RMSNorm as a megatron-core layer-spec module (``build_module(config=, hidden_size=, eps=)``).

    ``y = w * float(x) / sqrt(mean(float(x)^2) + eps)`` cast back to x's dtype before the scale, exactly as
    ``Qwen3MoeRMSNorm``. It takes the place of megatron-core's ``WrappedTorchNorm``, which refuses sequence
    parallelism (megatron-core needs sequence parallelism for MoE with TP in training). Its weight carries
    megatron's ``sequence_parallel`` attribute: under sequence parallelism each TP rank's gradient covers its
    tokens only, and the trainer all-reduces it over the TP group.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        self.eps = float(eps)
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x):
        dt = x.dtype
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(dt)


class CoreAttention(torch.nn.Module):
    """Causal softmax attention for megatron-core's MLA (``k_channels`` != ``v_channels``), as a layer-spec module.

    megatron-core 0.16.1 builds MLA's core attention with ``k_channels`` / ``v_channels``, which only Transformer
    Engine's attention accepts (its local ``DotProductAttention`` raises ``TypeError``). This is the plain
    computation: ``softmax(float32(q k^T) * scale, causal) v`` in the input dtype, query/key ``[s, b, n, dk]``,
    value ``[s, b, n, dv]`` -> ``[s, b, n * dv]``. No dropout (RL trainers run without it), no packed sequences.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        self.config = config
        self.softmax_scale = softmax_scale if softmax_scale is not None else (k_channels or config.kv_channels) ** -0.5

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_unused):
        if packed_seq_params is not None:
            raise InputError("packed sequences are not supported by this core attention", field="packed_seq_params")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, d]
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * self.softmax_scale
        sq, sk = scores.shape[-2:]
        causal = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(1 + sk - sq)
        probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1).to(v.dtype)
        out = torch.matmul(probs, v)  # [b, n, s, dv]
        return out.permute(2, 0, 1, 3).reshape(sq, out.shape[0], -1)


def layer_spec(num_experts: int | None, *, grouped_experts: bool = False, num_layers: int,
               qk_layernorm: bool = True):
    """megatron-core's local GPT layer spec with :class:`RMSNorm` for every norm (block spec for GPTModel);
    ``num_experts=None``: a dense MLP."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=grouped_experts,
                                    qk_layernorm=qk_layernorm, normalization="RMSNorm")
    sub = spec.submodules
    sub.input_layernorm = RMSNorm
    sub.pre_mlp_layernorm = RMSNorm
    if qk_layernorm:
        sub.self_attention.submodules.q_layernorm = RMSNorm
        sub.self_attention.submodules.k_layernorm = RMSNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * num_layers, layer_norm=RMSNorm)


def mla_block_spec(tc):
    """megatron-core's local decoder block spec for an MLA config (dense and MoE layers per
    ``moe_layer_freq``) with :class:`RMSNorm` for every norm and :class:`CoreAttention`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(tc, use_transformer_engine=False, normalization="RMSNorm")
    for ls in block.layer_specs:
        sub = ls.submodules
        sub.input_layernorm = RMSNorm
        sub.pre_mlp_layernorm = RMSNorm
        att = sub.self_attention.submodules
        att.q_layernorm = RMSNorm
        att.kv_layernorm = RMSNorm
        att.core_attention = CoreAttention
    block.layer_norm = RMSNorm
    return block


def build_gpt_model(config, *, tp: int = 1, ep: int = 1, dtype: torch.dtype = torch.float32,
                    grouped_experts: bool = False, route_replay: bool = True):
    """An (uninitialized-weight) megatron-core GPTModel for the HF config; parallel groups must exist.

    On CPU, build and run it inside :func:`skyrl_numerics.trainer.megatron.compat.cpu_compat`.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.moe.router_replay import RouterReplay

    cfg = hf_config_dict(config)
    tc = transformer_config(cfg, tp=tp, ep=ep, dtype=dtype, grouped_experts=grouped_experts,
                            route_replay=route_replay)
    if cfg["model_type"] == "deepseek_v3":
        spec = mla_block_spec(tc)
    else:
        spec = layer_spec(None if cfg["model_type"] in DENSE else cfg["num_experts"], grouped_experts=grouped_experts,
                          num_layers=cfg["num_hidden_layers"], qk_layernorm=cfg["model_type"] in QK_NORM)
    if route_replay:  # one RouterReplay per TopKRouter, in layer order: start from none
        RouterReplay.clear_global_router_replay_instances()
    rope = cfg["rope_theta"]
    model = GPTModel(config=tc, transformer_layer_spec=spec, vocab_size=cfg["vocab_size"],
                     max_sequence_length=cfg.get("max_position_embeddings", 4096), position_embedding_type="rope",
                     rotary_base=rope, share_embeddings_and_output_weights=False, parallel_output=True)
    return model.to(dtype)


def load_weights(model, state: dict) -> None:
    """Load this rank's megatron-core weights (:func:`~.mapping.shard_for_rank`); InputError on any mismatch.

    Only megatron's ``_extra_state`` entries (Transformer Engine / FP8 metadata, absent here) may be missing.
    """
    own = model.state_dict()
    want = {k for k in own if not k.endswith("_extra_state")}
    missing, extra = sorted(want - set(state)), sorted(set(state) - set(own))
    if missing or extra:
        raise InputError(f"weights do not match the model: missing {missing[:3]}, unexpected {extra[:3]}",
                         field=(missing or extra)[0])
    for k in want:
        if tuple(own[k].shape) != tuple(state[k].shape):
            raise InputError(f"{k}: shape {tuple(state[k].shape)}, the model has {tuple(own[k].shape)}", field=k)
    model.load_state_dict({k: state[k] for k in want}, strict=False)
