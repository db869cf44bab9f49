"""MoE dimensions of a Hugging Face config, read in one place.

HF families spell the same MoE fields differently (transformers 5 config classes map some names
onto others with ``attribute_map``, but a ``config.json`` holds only the stored name):

==================  ======================  ===================  =========================
family              routed experts          expert width         dense / shared layers
==================  ======================  ===================  =========================
Qwen2/3-MoE, OLMoE  ``num_experts``         ``moe_intermediate`` ``mlp_only_layers``,
                    (transformers 5:        ``_size``            ``decoder_sparse_step``;
                    ``num_local_experts``)                       Qwen2: shared expert width
DeepSeek-V2/V3,     ``n_routed_experts``    ``moe_intermediate`` ``first_k_dense_replace``,
GLM-4-MoE                                   ``_size``            ``moe_layer_freq``,
                                                                 ``n_shared_experts``
Mixtral, GPT-OSS    ``num_local_experts``   ``intermediate_size`` every layer MoE
==================  ======================  ===================  =========================

:func:`moe_dims` reads them with **one** precedence order: the routed expert count is the first
of :data:`NUM_EXPERTS_KEYS` holding a positive integer (``n_routed_experts`` first: the one name
that never counts shared experts); the expert width is ``moe_intermediate_size``, else
``intermediate_size`` (families whose every MLP is an MoE). A multimodal config's
``text_config`` is read when the top level names no experts. Layer ``i`` is an MoE layer when
``i >= first_k_dense_replace``, ``i % moe_layer_freq == 0``, ``i not in mlp_only_layers`` and
``(i + 1) % decoder_sparse_step == 0`` (each family's own rule; the others' fields are absent and
hold their neutral defaults). Nemotron-H names each block's kind (``layers_block_type``, or
NVIDIA's ``hybrid_override_pattern`` letters in a ``config.json``): its MoE layers are the
``moe`` blocks, and a config without any is dense whatever expert count it carries (its config
class stores ``n_routed_experts`` by default).
"""
from __future__ import annotations

from dataclasses import dataclass

#: config keys of the routed expert count, in the order they are read
NUM_EXPERTS_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")


@dataclass(frozen=True)
class MoEDims:
    """What the readers of an HF config need about its MoE (``num_experts == 0``: dense)."""
    num_experts: int = 0
    top_k: int = 0                       # num_experts_per_tok
    moe_intermediate: int | None = None  # one routed expert's width
    n_shared: int = 0                    # shared experts per MoE layer
    first_dense: int = 0                 # first_k_dense_replace
    layer_freq: int = 1                  # moe_layer_freq
    sparse_step: int = 1                 # decoder_sparse_step
    dense_layers: tuple = ()             # mlp_only_layers
    num_layers: int = 0                  # num_hidden_layers

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        return (self.is_moe and i >= self.first_dense and i % self.layer_freq == 0
                and i not in self.dense_layers and (i + 1) % self.sparse_step == 0)

    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]


def _get(cfg, key):
    return cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key, None)


def _pos_int(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _num_experts(cfg) -> int:
    for k in NUM_EXPERTS_KEYS:
        v = _pos_int(_get(cfg, k))
        if v is not None:
            return v
    return 0


def _text(cfg):
    """The config holding the language model's fields (a multimodal config's ``text_config``)."""
    sub = _get(cfg, "text_config")
    return sub if sub is not None and not _num_experts(cfg) and _num_experts(sub) else cfg


#: Nemotron-H's one-letter block kinds (``hybrid_override_pattern``, NVIDIA's config.json)
NEMOTRON_PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}


def nemotron_block_types(cfg) -> list | None:
    """A Nemotron-H config's block kind per layer: ``layers_block_type`` (transformers 5's
    name; ``layer_types`` its alias), else NVIDIA's ``hybrid_override_pattern`` string (``M``
    Mamba-2, ``E`` MoE, ``*`` attention, ``-`` MLP), read as transformers reads it; ``None``
    when the config has neither."""
    for key in ("layers_block_type", "layer_types"):
        v = _get(cfg, key)
        if isinstance(v, (list, tuple)):
            return list(v)
    pattern = _get(cfg, "hybrid_override_pattern")
    if isinstance(pattern, str) and set(pattern) <= set(NEMOTRON_PATTERN):
        return [NEMOTRON_PATTERN[ch] for ch in pattern]
    return None


def moe_dims(cfg) -> MoEDims:
    """The :class:`MoEDims` of an HF config: a ``config.json`` dict, a ``PretrainedConfig`` or any
    object with the fields as attributes (module docstring: names and precedence)."""
    c = _text(cfg)
    experts = _num_experts(c)
    if not experts:
        return MoEDims(num_layers=_pos_int(_get(c, "num_hidden_layers")) or 0)
    # Nemotron-H: the MoE layers are its moe blocks (GraniteMoeHybrid's block types name the
    # mixer only: every one of its layers is MoE)
    blocks = nemotron_block_types(c) if _get(c, "model_type") == "nemotron_h" else None
    n_layers = _pos_int(_get(c, "num_hidden_layers")) or (len(blocks) if blocks else 0)
    if blocks is not None and "moe" not in blocks:
        return MoEDims(num_layers=n_layers)
    dense = (tuple(i for i, t in enumerate(blocks) if t != "moe") if blocks is not None
             else tuple(_get(c, "mlp_only_layers") or ()))
    shared = _get(c, "n_shared_experts")
    if shared is None:     # Qwen2-MoE: one shared expert of its own width
        shared = 1 if _pos_int(_get(c, "shared_expert_intermediate_size")) else 0
    return MoEDims(
        num_experts=experts, top_k=_pos_int(_get(c, "num_experts_per_tok")) or 0,
        moe_intermediate=_pos_int(_get(c, "moe_intermediate_size")) or _pos_int(_get(c, "intermediate_size")),
        n_shared=int(shared or 0), first_dense=int(_get(c, "first_k_dense_replace") or 0),
        layer_freq=int(_get(c, "moe_layer_freq") or 1), sparse_step=int(_get(c, "decoder_sparse_step") or 1),
        dense_layers=dense, num_layers=n_layers)


def moe_layout(cfg) -> tuple[int, list[int]] | None:
    """``(num_experts, indices of the MoE layers)`` of an HF config, or ``None`` for a dense
    model. vLLM's ``routed_experts`` has a row per hidden layer; these are the ones with a
    router (:meth:`MoEDims.is_moe_layer`)."""
    d = moe_dims(cfg)
    if not d.is_moe or not d.num_layers:
        return None
    return d.num_experts, d.moe_layers()
