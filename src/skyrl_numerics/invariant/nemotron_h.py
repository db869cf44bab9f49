"""Nemotron-H (``NemotronHForCausalLM``), batch-invariant: family ``nemotron_h``.

One mixer per block, ``h = h + mixer(rms_norm(h))`` (weights under ``backbone.``), the mixer
chosen by ``layers_block_type``: Mamba-2 (``linear_attention``), GQA attention without any
position embedding (``full_attention``), or a ReLU² MLP (``mlp``: ``down(relu(up x)^2)``).
HF transformers 5.19's ``modeling_nemotron_h.py`` math, ops from :mod:`.blocks`::

    Mamba-2:  [z | xBC | dt] = x W_in;  xBC = silu(causal_conv1d(xBC) + conv_bias)
              x, B, C = split(xBC)  (x: H heads of P, B/C: G groups of N, shared by H/G heads)
              dt = max(softplus(dt + dt_bias), time_step_min);  A = -exp(A_log)     (fp32)
              per token, per head (fp32):  S = S exp(dt A) + (dt x) B^T;  y = S C + D x
              y = group_rms_norm(y * silu(z)) * w;   out = y W_out

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

from .base import Attend, InvariantCausalLM
from .blocks import linear, linear_many, require, rms_norm
from .gqa import AttnDims, GQAttention
from .recurrent import FreshSequences, causal_conv, pointwise

MAMBA, ATTN, MLP = "linear_attention", "full_attention", "mlp"


@dataclass(frozen=True)
class Dims:
    vocab: int
    hidden: int
    layers: int
    block_types: tuple
    inter: int
    eps: float


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
    types = tuple(g("layers_block_type") or g("layer_types") or ())
    n_layers = int(g("num_hidden_layers") or len(types))     # (HF derives it from the types)
    require(len(types) == n_layers and set(types) <= {MAMBA, ATTN, MLP},
            "layers_block_type", list(types),
            "the invariant Nemotron-H runs Mamba-2, attention and MLP blocks (not 'moe')")
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
                block_types=types, inter=int(g("intermediate_size") or 0), eps=c.layer_norm_epsilon)
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
            else:
                self.add(p + "up_proj.weight", d.inter, d.hidden)
                self.add(p + "down_proj.weight", d.hidden, d.inter)

    @classmethod
    def config_parts(cls, cfg, dtype: torch.dtype = torch.bfloat16, kv_cache=None) -> dict:
        dims, attn, mamba = config_dims(cfg)
        attn.kv_format(dtype, kv_cache)
        return dict(dims=dims, attn=attn, mamba=mamba, dtype=dtype, kv_cache=kv_cache)

    @staticmethod
    def state_shapes_of_config(cfg) -> tuple:
        return config_dims(cfg)[2].state_shapes()

    def route_info(self) -> dict:
        return {"layers": 0, "k": 0, "num_experts": 0}

    def moe_layer_ids(self):
        return None

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
            else:
                u = torch.relu(linear(x, self.proj(p + "mixer.up_proj.weight")))
                h = h + linear(u * u, self.proj(p + "mixer.down_proj.weight"))
        return rms_norm(h, self.w("backbone.norm_f.weight"), d.eps)

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
