"""Nemotron-H (``NemotronHForCausalLM``), batch-invariant: family ``nemotron_h``.

One mixer per block, ``h = h + mixer(rms_norm(h))`` (weights under ``backbone.``), the mixer
chosen by ``layers_block_type``: Mamba-2 (``linear_attention``), GQA attention without any
position embedding (``full_attention``), a ReLU² MLP (``mlp``: ``down(relu(up x)^2)``), or a
routed MoE (``moe``, Nemotron 3). HF transformers 5.19's ``modeling_nemotron_h.py`` math, ops
from :mod:`.blocks`::

    Mamba-2:  [z | xBC | dt] = x W_in;  xBC = silu(causal_conv1d(xBC) + conv_bias)
              x, B, C = split(xBC)  (x: H heads of P, B/C: G groups of N, shared by H/G heads)
              dt = max(softplus(dt + dt_bias), time_step_min);  A = -exp(A_log)     (fp32)
              per token, per head (fp32):  S = S exp(dt A) + (dt x) B^T;  y = S C + D x
              y = group_rms_norm(y * silu(z)) * w;   out = y W_out
    MoE:      s = sigmoid(x W_gate in fp32);  ids = group-limited top-k of s + e_score_correction_bias
              (n_group groups, topk_group kept);  w = s[ids] / (sum + 1e-20) (norm_topk_prob)
              · routed_scaling_factor                      (:meth:`~.base.InvariantCausalLM.sigmoid_routed`)
              out = sum_s w_s relu2_expert_{ids_s}(x) + shared(x)        (non-gated ReLU² experts)
              LatentMoE (``moe_latent_size`` L):  out = (sum_s w_s expert_{ids_s}(x W1^T)) W2^T
              + shared(x), experts of width L (``fc1_latent_proj`` W1, ``fc2_latent_proj`` W2)

Routes are numbered over the ``moe`` blocks in layer order (vLLM's ``moe_layers``). MTP draft
layers (``mtp.*`` tensors) are skipped, as HF and vLLM skip them.

Fixed order as :mod:`.qwen3_next`'s Gated DeltaNet (the same causal conv; every dot product over
``N`` with :func:`~skyrl_numerics.kernels.fixed_order.dot8`; transcendentals elementwise), so a
token's bits do not depend on the batch nor on chunking. The state of a sequence is
``(conv [K-1, conv_dim] model dtype, S [H, P, N] fp32)``; who keeps it is
:attr:`InvariantNemotronH.recurrent` (as in :mod:`.qwen3_next`: ``None`` = the trainer's
whole sequences from zero state).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from skyrl_numerics.kernels.fixed_order import dot8

from skyrl_numerics.hf_config import moe_dims, nemotron_block_types

from .base import Attend, InvariantCausalLM
from .blocks import linear, linear_many, relu2_mlp, require, rms_norm
from .gqa import AttnDims, GQAttention
from .recurrent import FreshSequences, causal_conv, pointwise

MAMBA, ATTN, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
EXPERT_NAMES = ("up_proj", "down_proj")      # the non-gated experts' two projections


@dataclass(frozen=True)
class Dims:
    vocab: int
    hidden: int
    layers: int
    block_types: tuple
    inter: int
    eps: float
    moe: "MoEBlockDims | None" = None

    @property
    def moe_layers(self) -> tuple:
        """The ``moe`` blocks' layer indices (route ``j`` is layer ``moe_layers[j]``)."""
        return tuple(i for i, t in enumerate(self.block_types) if t == MOE)


@dataclass(frozen=True)
class MoEBlockDims:
    """The ``moe`` blocks' sizes and router (the names :meth:`~.base.InvariantCausalLM.
    sigmoid_routed` reads); ``latent``: ``moe_latent_size`` (None: the experts see the hidden
    state itself)."""
    experts: int
    top_k: int
    moe_inter: int
    shared_inter: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling: float
    latent: int | None


def moe_block_dims(c) -> MoEBlockDims:
    """The MoE of a config with ``moe`` blocks; refuses what HF's and vLLM's NemotronH do not
    agree on, naming the field."""
    g = lambda name, default=None: getattr(c, name, default)  # noqa: E731
    moe = moe_dims(c)
    experts = moe.num_experts
    require(experts > 0, "n_routed_experts", g("n_routed_experts"), "a routed expert count is needed")
    require(0 < moe.top_k <= experts, "num_experts_per_tok", g("num_experts_per_tok"),
            f"must be in 1 .. n_routed_experts {experts}")
    n_group, topk_group = int(g("n_group", 1) or 1), int(g("topk_group", 1) or 1)
    require(experts % n_group == 0, "n_group", n_group, f"must divide n_routed_experts {experts}")
    require(n_group == 1 or experts // n_group >= 2, "n_group", n_group,
            "group scores sum the top-2 experts of a group: groups need >= 2 experts")
    require(1 <= topk_group <= n_group, "topk_group", topk_group, f"must be in 1 .. n_group {n_group}")
    # HF always adds one shared expert of moe_shared_expert_intermediate_size; vLLM one of
    # n_shared_experts times that width, none for 0: they agree at 1 only
    require(g("n_shared_experts", 1) == 1, "n_shared_experts", g("n_shared_experts"),
            "HF's NemotronH always has one shared expert; vLLM's width scales with this count")
    latent = g("moe_latent_size")
    require(latent is None or int(latent) > 0, "moe_latent_size", latent, "must be positive")
    return MoEBlockDims(experts=experts, top_k=moe.top_k, moe_inter=int(moe.moe_intermediate),
                        shared_inter=int(g("moe_shared_expert_intermediate_size")),
                        n_group=n_group, topk_group=topk_group,
                        norm_topk_prob=bool(g("norm_topk_prob", True)),
                        routed_scaling=float(g("routed_scaling_factor", 1.0) or 1.0),
                        latent=None if latent is None else int(latent))


@dataclass(frozen=True)
class MambaDims:
    """Mamba-2 sizes: ``heads`` of ``head_dim``, ``groups`` of B/C with ``state`` dims each, a
    conv of ``kernel`` taps over ``conv_dim = heads·head_dim + 2·groups·state`` channels."""
    heads: int
    head_dim: int
    groups: int
    state: int
    kernel: int
    dt_min: float

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.groups * self.state

    def state_shapes(self) -> tuple:
        """``(conv [K-1, conv_dim], S [heads, head_dim, state])`` of one sequence."""
        return (self.kernel - 1, self.conv_dim), (self.heads, self.head_dim, self.state)


def config_dims(c):
    g = lambda name, default=None: getattr(c, name, default)  # noqa: E731
    types = tuple(nemotron_block_types(c) or ())
    n_layers = int(g("num_hidden_layers") or len(types))     # (HF derives it from the types)
    require(len(types) == n_layers and set(types) <= {MAMBA, ATTN, MLP, MOE},
            "layers_block_type", list(types),
            "the invariant Nemotron-H runs Mamba-2, attention, MLP and MoE blocks, one per layer")
    require(g("block_configs") is None, "block_configs", "(per-layer)",
            "heterogeneous (per-layer) Nemotron-H configs are not implemented")
    require(g("mlp_hidden_act", "relu2") == "relu2", "mlp_hidden_act", g("mlp_hidden_act"), "only relu2")
    require(g("mamba_hidden_act", "silu") == "silu", "mamba_hidden_act", g("mamba_hidden_act"), "only silu")
    for f in ("use_bias", "mlp_bias", "attention_bias", "tie_word_embeddings", "residual_in_fp32"):
        require(not g(f, False), f, True, "not implemented")
    require(bool(g("use_conv_bias", True)), "use_conv_bias", False, "the conv's bias is expected")
    m = MambaDims(int(c.mamba_num_heads), int(c.mamba_head_dim), int(c.n_groups),
                  int(c.ssm_state_size), int(c.conv_kernel), float(g("time_step_min", 0.001)))
    require(m.heads % m.groups == 0, "n_groups", m.groups, f"must divide mamba_num_heads {m.heads}")
    head_dim = g("head_dim") or c.hidden_size // c.num_attention_heads
    attn = AttnDims(hidden=c.hidden_size, layers=n_layers, heads=c.num_attention_heads,
                    kv_heads=g("num_key_value_heads") or c.num_attention_heads, head_dim=head_dim,
                    eps=c.layer_norm_epsilon, qk_norm=False, qkv_bias=False, o_bias=False)
    dims = Dims(vocab=c.vocab_size, hidden=c.hidden_size, layers=n_layers,
                block_types=types, inter=int(g("intermediate_size") or 0), eps=c.layer_norm_epsilon,
                moe=moe_block_dims(c) if MOE in types else None)
    return dims, attn, m


def ssd_scan(x, dt, A, B, C, D, S):
    """Mamba-2's recurrence token by token in fp32: ``x [b, n, H, P]``, ``dt [b, n, H]``,
    ``A, D [H]``, ``B, C [b, n, H, N]`` (groups repeated to heads), ``S [b, H, P, N]`` ->
    ``(y [b, n, H, P], S)``; the dot product over ``N`` in :func:`dot8`'s order."""
    dA = pointwise(torch.exp, dt * A)
    xdt = x * dt[..., None]
    outs = []
    for t in range(x.shape[1]):
        S = S * dA[:, t, :, None, None] + xdt[:, t, :, :, None] * B[:, t, :, None, :]
        outs.append(dot8(S, C[:, t, :, None, :]) + x[:, t] * D[:, None])
    return torch.stack(outs, dim=1), S


class InvariantNemotronH(GQAttention, InvariantCausalLM):
    """Parameters under HF names (``backbone.`` prefix); ``forward_tokens`` runs the stream."""

    def __init__(self, dims: Dims, attn: AttnDims, mamba: MambaDims,
                 dtype: torch.dtype = torch.bfloat16, kv_cache=None):
        super().__init__(dtype)
        self.dims, self.mamba_dims, self.attn_dims = d, m, a = dims, mamba, attn
        self.recurrent = None
        self._moe_index = {layer: j for j, layer in enumerate(d.moe_layers)}
        self.rope, self.scale = None, a.head_dim ** -0.5
        self.kv = a.kv_format(dtype, kv_cache)
        self.add("backbone.embeddings.weight", d.vocab, d.hidden)
        self.add("backbone.norm_f.weight", d.hidden)
        self.add("lm_head.weight", d.vocab, d.hidden)
        for i, kind in enumerate(d.block_types):
            p = f"backbone.layers.{i}."
            self.add(p + "norm.weight", d.hidden)
            p += "mixer."
            if kind == MAMBA:
                self.add(p + "in_proj.weight", m.inner + m.conv_dim + m.heads, d.hidden)
                self.add(p + "conv1d.weight", m.conv_dim, 1, m.kernel)
                self.add(p + "conv1d.bias", m.conv_dim)
                for n in ("A_log", "D", "dt_bias"):
                    self.add(p + n, m.heads)
                self.add(p + "norm.weight", m.inner)
                self.add(p + "out_proj.weight", d.hidden, m.inner)
            elif kind == ATTN:
                q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
                for n, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                    self.add(p + f"{n}.weight", rows, d.hidden)
                self.add(p + "o_proj.weight", d.hidden, q)
            elif kind == MOE:
                self.add_moe(p)
            else:
                self.add(p + "up_proj.weight", d.inter, d.hidden)
                self.add(p + "down_proj.weight", d.hidden, d.inter)

    def add_moe(self, p: str) -> None:
        """One ``moe`` block's weights under ``p`` (``backbone.layers.<i>.mixer.``)."""
        d, m = self.dims, self.dims.moe
        width = m.latent or d.hidden
        self.add(p + "gate.weight", m.experts, d.hidden)
        self.add(p + "gate.e_score_correction_bias", m.experts, dtype=torch.float32)
        for e in range(m.experts):
            self.add(p + f"experts.{e}.up_proj.weight", m.moe_inter, width)
            self.add(p + f"experts.{e}.down_proj.weight", width, m.moe_inter)
        self.add(p + "shared_experts.up_proj.weight", m.shared_inter, d.hidden)
        self.add(p + "shared_experts.down_proj.weight", d.hidden, m.shared_inter)
        if m.latent:
            self.add(p + "fc1_latent_proj.weight", m.latent, d.hidden)
            self.add(p + "fc2_latent_proj.weight", d.hidden, m.latent)

    @classmethod
    def config_parts(cls, cfg, dtype: torch.dtype = torch.bfloat16, kv_cache=None) -> dict:
        dims, attn, mamba = config_dims(cfg)
        attn.kv_format(dtype, kv_cache)
        return dict(dims=dims, attn=attn, mamba=mamba, dtype=dtype, kv_cache=kv_cache)

    @staticmethod
    def state_shapes_of_config(cfg) -> tuple:
        return config_dims(cfg)[2].state_shapes()

    def route_info(self) -> dict:
        m = self.dims.moe
        if m is None:
            return {"layers": 0, "k": 0, "num_experts": 0}
        return {"layers": len(self.dims.moe_layers), "k": m.top_k, "num_experts": m.experts}

    def moe_layer_ids(self):
        return list(self.dims.moe_layers) if self.dims.moe is not None else None

    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.dims.block_types) if t == MAMBA]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.w("backbone.embeddings.weight")[input_ids]

    # ---- forward ------------------------------------------------------------------------
    def forward_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       attend: Attend) -> torch.Tensor:
        d = self.dims
        h = self.embed(input_ids)
        for i, kind in enumerate(d.block_types):
            p = f"backbone.layers.{i}."
            x = rms_norm(h, self.w(p + "norm.weight"), d.eps)
            if kind == MAMBA:
                h = h + self.mamba(i, x, positions)
            elif kind == ATTN:
                h = h + self.attention(i, x, positions, attend)
            elif kind == MOE:
                h = h + self.moe(i, x)
            else:
                h = h + relu2_mlp(x, self.proj(p + "mixer.up_proj.weight"),
                                  self.proj(p + "mixer.down_proj.weight"))
        return rms_norm(h, self.w("backbone.norm_f.weight"), d.eps)

    def moe(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """HF's ``NemotronHMoE``: the routed experts' weighted sum (through the latent when
        there is one), then the shared expert's output added."""
        d, p = self.dims, f"backbone.layers.{i}.mixer."
        latent = ((self.proj(p + "fc1_latent_proj.weight"), self.proj(p + "fc2_latent_proj.weight"))
                  if d.moe.latent else None)
        out = self.sigmoid_routed(self._moe_index[i], x, p, d.moe, names=EXPERT_NAMES, latent=latent)
        return out + relu2_mlp(x, self.proj(p + "shared_experts.up_proj.weight"),
                               self.proj(p + "shared_experts.down_proj.weight"))

    def attention(self, i, x, positions, attend):
        a, p, T = self.attn_dims, f"backbone.layers.{i}.mixer.", x.shape[0]
        q, k, v = linear_many(x, [self.proj(p + f"{n}.weight") for n in ("q_proj", "k_proj", "v_proj")])
        rows = torch.cat([k, v], dim=-1)
        o = attend(i, q.view(T, a.heads, a.head_dim), rows)
        return linear(o.reshape(T, -1), self.proj(p + "o_proj.weight"))

    def mamba(self, i: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        m, p, T = self.mamba_dims, f"backbone.layers.{i}.mixer.", x.shape[0]
        zxbcdt = linear(x, self.proj(p + "in_proj.weight"))
        z, xbc, dt = torch.split(zxbcdt, [m.inner, m.conv_dim, m.heads], dim=-1)
        dt = pointwise(torch.nn.functional.softplus, dt.float() + self.w(p + "dt_bias").float())
        dt = torch.clamp(dt, min=m.dt_min)
        keeper = self.recurrent if self.recurrent is not None else FreshSequences()
        y = keeper.mix(self, i, xbc, dt, dt, positions)                   # [T, H, P] fp32
        y = y.reshape(T, m.inner) * pointwise(torch.nn.functional.silu, z.float())
        gs = m.inner // m.groups
        y = rms_norm(y.reshape(T * m.groups, gs), torch.ones(gs), self.dims.eps).reshape(T, m.inner)
        y = (y * self.w(p + "norm.weight").float()).to(x.dtype)
        return linear(y, self.proj(p + "out_proj.weight"))

    def scan(self, i: int, xbc: torch.Tensor, dt: torch.Tensor, _unused, conv0, S0):
        """The stateful part of Mamba layer ``i`` for ``b`` sequences of ``n`` new tokens:
        ``xbc [b, n, conv_dim]`` (conv inputs), ``dt [b, n, H]`` fp32, states ``conv0
        [b, K-1, conv_dim]``, ``S0 [b, H, P, N]`` -> ``(y [b, n, H, P] fp32, conv, S)``."""
        m, p = self.mamba_dims, f"backbone.layers.{i}.mixer."
        b, n = xbc.shape[:2]
        w = self.w(p + "conv1d.weight")[:, 0]
        c, conv = causal_conv(xbc, w, conv0, bias=self.w(p + "conv1d.bias"))
        r = m.heads // m.groups
        gn = m.groups * m.state
        x = c[..., :m.inner].reshape(b, n, m.heads, m.head_dim).float()
        B = c[..., m.inner:m.inner + gn].reshape(b, n, m.groups, m.state).float().repeat_interleave(r, dim=2)
        C = c[..., m.inner + gn:].reshape(b, n, m.groups, m.state).float().repeat_interleave(r, dim=2)
        A = -pointwise(torch.exp, self.w(p + "A_log").float())
        y, S = ssd_scan(x, dt.float(), A, B, C, self.w(p + "D").float(), S0.float())
        return y, conv, S

    def state_shapes(self) -> tuple:
        return self.mamba_dims.state_shapes()

    def zero_state(self, b: int):
        (ck, cc), (h, hd, n) = self.mamba_dims.state_shapes()
        return torch.zeros(b, ck, cc, dtype=self.dtype), torch.zeros(b, h, hd, n)
