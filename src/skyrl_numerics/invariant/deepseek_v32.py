"""DeepSeek-V3.2 (DSA: MLA + a lightning indexer), batch-invariant: family ``deepseek_v32``.

DeepSeek-V3's absorbed MLA and MoE (:mod:`.deepseek_v3`), with DeepSeek Sparse Attention: per
layer an indexer scores every visible key of each query and the attention reads only the
``index_topk`` best (HF transformers' ``DeepseekV32Indexer``, its bf16 formulation: no Hadamard
rotation, no FP8 scoring). With ``qa = rms_norm(x Wq_a)`` (MLA's query latent), index heads Hi of
dim Di and ``rope_neox`` the rotate-half RoPE of the first Dr dims (the indexer's; MLA's is GPT-J
style)::

    qi[h] = rope_neox(qa Wq_b_idx)[h]                    [T, Hi, Di]
    ki    = rope_neox(layer_norm(x Wk, k_norm))          [T, Di]   (cached with the MLA latent)
    wt[h] = (x W_weights)[h] · Hi^-1/2                   fp32
    I[s, t] = Σ_h wt[s, h] · relu(dot(qi[s, h], ki[t]) · Di^-1/2)     (h summed left to right)
    keys(s) = the min(index_topk, pos(s) + 1) keys t <= pos(s) of largest I[s, t]
              (ties: the lower position first), attended in position order

The cache row of a token is ``[c | k_pe | ki]`` (``kv_lora_rank + qk_rope_head_dim +
index_head_dim``; format ``auto`` only: vLLM's FP8 indexer cache is not reproduced). Every
operation of the selection is per element or a fixed-order dot product (``dot8``), so a query's
keys depend only on its own row and the cached rows, never on the batch; the attention over the
selected keys is the invariant kernel with ``kv_len`` = their number, which for a query with at
most ``index_topk`` visible keys is exactly dense causal attention. The selected positions are
handed to ``index_hook(layer, positions [T, K], counts [T])`` when set (the DSA analogue of
MoE routes; ``K = min(index_topk, keys)``); ``index_source`` set, the selection comes from it
instead (the engine's choices replayed: :mod:`skyrl_numerics.replay.index_replay`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from skyrl_numerics.kernels import sum as inv_sum
from skyrl_numerics.kernels.fixed_order import dot8

from .blocks import head_matmuls, linear, require, rms_norm
from .deepseek_v3 import Dims, InvariantDeepseekV3
from .kv_format import KVFormat, parse_kv_spec

# elements of one chunk of indexer products (queries x heads x keys x Di) held at once
_SCORE_CHUNK = 1 << 22


@dataclass(frozen=True)
class IndexDims:
    topk: int
    heads: int
    head_dim: int


def _v3_view(cfg):
    """The config as DeepSeek-V3's :class:`Dims` reads it: V3.2's router is always ``noaux_tc``
    on sigmoid scores (HF's ``DeepseekV32TopkRouter``), its dense layers are
    ``mlp_layer_types``' leading ``dense`` run."""
    fields = dict(vars(cfg)) if not isinstance(cfg, dict) else dict(cfg)
    fields.setdefault("topk_method", "noaux_tc")
    fields.setdefault("scoring_func", "sigmoid")
    fields.setdefault("rope_interleave", True)
    types = fields.get("mlp_layer_types")
    if types:
        first = int(fields.get("first_k_dense_replace", 0) or 0)
        want = ["dense"] * first + ["sparse"] * (len(types) - first)
        require(list(types) == want, "mlp_layer_types", types,
                f"only first_k_dense_replace ({first}) dense layers, then MoE, are implemented")
    fields.pop("index_topk", None)
    return SimpleNamespace(**fields)


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim in fp32 with fixed-order sums:
    ``(x - mean) / sqrt(var + eps) · w + b``, rounded once to ``x.dtype``."""
    xf = x.float()
    n = xf.shape[-1]
    xc = xf - inv_sum(xf, -1, keepdim=True) / n
    var = inv_sum(xc * xc, -1, keepdim=True) / n
    return (xc / torch.sqrt(var + eps) * w.float() + b.float()).to(x.dtype)


class InvariantDeepseekV32(InvariantDeepseekV3):
    """DeepSeek-V3 plus the indexer's weights (``self_attn.indexer.*``) and sparse attention."""

    def __init__(self, dims: Dims, rope, scale: float, index: IndexDims,
                 dtype: torch.dtype = torch.bfloat16, kv_cache=None):
        super().__init__(dims, rope, scale, dtype=dtype, kv_cache=kv_cache)
        d = dims
        self.index = index
        self.index_rope = dataclasses.replace(rope, style="neox")
        self.index_hook = None
        # (layer, qi, wt, ki, pos, select) -> (sel, count): replayed choices (replay/index_replay.py)
        self.index_source = None
        self.kv = KVFormat("mla", d.kv_lora_rank, d.kv_lora_rank + d.rope + index.head_dim, dtype,
                           parse_kv_spec(kv_cache), d.layers)
        for i in range(d.layers):
            p = f"model.layers.{i}.self_attn.indexer."
            self.add(p + "wq_b.weight", index.heads * index.head_dim, d.q_lora_rank)
            self.add(p + "wk.weight", index.head_dim, d.hidden)
            self.add(p + "k_norm.weight", index.head_dim)
            self.add(p + "k_norm.bias", index.head_dim)
            self.add(p + "weights_proj.weight", index.heads, d.hidden)

    @classmethod
    def config_parts(cls, cfg, dtype: torch.dtype = torch.bfloat16, kv_cache=None) -> dict:
        g = lambda name, default=None: getattr(cfg, name, default)  # noqa: E731
        spec = parse_kv_spec(kv_cache)
        require(spec["format"] == "auto", "kv_cache", spec["format"],
                "DeepSeek-V3.2's indexer keys are cached in the model dtype only (vLLM's FP8 "
                "indexer cache is not reproduced)")
        require(bool(g("q_lora_rank")), "q_lora_rank", g("q_lora_rank"),
                "the DSA indexer reads MLA's query latent: q_lora_rank is needed")
        index = IndexDims(topk=int(g("index_topk", 2048)), heads=int(g("index_n_heads", 64)),
                          head_dim=int(g("index_head_dim", 128)))
        require(index.topk > 0, "index_topk", index.topk, "must be positive")
        require(index.head_dim >= g("qk_rope_head_dim", 64), "index_head_dim", index.head_dim,
                "the indexer rotates its first qk_rope_head_dim dims")
        parts = InvariantDeepseekV3.config_parts(_v3_view(cfg), dtype=dtype)
        return dict(parts, index=index, kv_cache=kv_cache)

    def _paged_kv(self, pool):
        return None          # the selection needs the rows: gather, then attn_core

    # ---- forward ------------------------------------------------------------------------
    def attention(self, i: int, x: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """MLA as DeepSeek-V3's; the queries handed to ``attend`` carry the indexer's query and
        head weights after MLA's (one flat row per token, unpacked by :meth:`attn_core`), the
        cache rows the indexer key after the latent."""
        d, p = self.dims, f"model.layers.{i}.self_attn."
        T, R = x.shape[0], d.kv_lora_rank
        qa = rms_norm(linear(x, self.proj(p + "q_a_proj.weight")),
                      self.w(p + "q_a_layernorm.weight"), d.eps)
        q = linear(qa, self.proj(p + "q_b_proj.weight")).view(T, d.heads, d.nope + d.rope)
        cs = self.rope_cos_sin(positions)
        q_nope, q_pe = q[..., :d.nope], self.rope(q[..., d.nope:], positions, cs)
        kv_a = linear(x, self.proj(p + "kv_a_proj_with_mqa.weight"))
        c = rms_norm(kv_a[:, :R], self.w(p + "kv_a_layernorm.weight"), d.eps)
        k_pe = self.rope(kv_a[:, None, R:], positions, cs)[:, 0]
        qi, ki, wt = self._indexer(i, x, qa, positions, cs)
        rows = torch.cat([c, k_pe, ki], dim=-1)
        wkv = self.served_weight(p + "kv_b_proj.weight").view(d.heads, d.nope + d.v_dim, R)
        q_lat = head_matmuls(q_nope, [wkv[h, :d.nope] for h in range(d.heads)])   # [T, H, R]
        packed = torch.cat([torch.cat([q_lat, q_pe], -1).reshape(T, -1),
                            qi.reshape(T, -1), wt], dim=-1)[:, None]
        o_lat = attend(i, packed, rows)                                           # [T, H, R]
        o = head_matmuls(o_lat, [wkv[h, d.nope:].t() for h in range(d.heads)])
        return linear(o.reshape(T, d.heads * d.v_dim), self.proj(p + "o_proj.weight"))

    def _indexer(self, i, x, qa, positions, cs):
        """-> (qi ``[T, Hi, Di]``, ki ``[T, Di]``, head weights ``[T, Hi]``), model dtype."""
        d, ix = self.dims, self.index
        p = f"model.layers.{i}.self_attn.indexer."
        T = x.shape[0]
        qi = linear(qa, self.proj(p + "wq_b.weight")).view(T, ix.heads, ix.head_dim)
        qi = torch.cat([self.index_rope(qi[..., :d.rope], positions, cs), qi[..., d.rope:]], -1)
        ki = layer_norm(linear(x, self.proj(p + "wk.weight")), self.w(p + "k_norm.weight"),
                        self.w(p + "k_norm.bias"), 1e-6)
        ki = torch.cat([self.index_rope(ki[:, None, :d.rope], positions, cs)[:, 0],
                        ki[:, d.rope:]], -1)
        wt = linear(x, self.proj(p + "weights_proj.weight"))
        return qi, ki, wt

    def attn_core(self, layer, q, rows, kv_lens):
        """q ``[n, Sq, 1, packed]``, rows ``[n, L, R + Dr + Di]`` -> ``o_lat [n, Sq, H, R]``:
        the indexer's selection (module doc), then MLA attention over the selected rows."""
        d, ix = self.dims, self.index
        n, Sq, L = q.shape[0], q.shape[1], rows.shape[1]
        W = d.kv_lora_rank + d.rope
        q = q.reshape(n, Sq, -1)
        q_main = q[..., :d.heads * W].reshape(n, Sq, d.heads, W)
        qi = q[..., d.heads * W:d.heads * W + ix.heads * ix.head_dim].reshape(
            n, Sq, ix.heads, ix.head_dim)
        wt = q[..., d.heads * W + ix.heads * ix.head_dim:].float() * ix.heads ** -0.5  # [n, Sq, Hi]
        dev = rows.device
        lens = (torch.full((n,), L, dtype=torch.int64) if kv_lens is None
                else torch.as_tensor(kv_lens, dtype=torch.int64).reshape(n)).to(dev)
        pos = lens[:, None] - Sq + torch.arange(Sq, device=dev)[None, :]           # [n, Sq]
        if self.index_source is not None:      # the engine's choices (R3 for the attention)
            sel, count = self.index_source(layer, qi, wt, rows[..., W:], pos, self._select)
        else:
            sel, count = self._select(qi, wt, rows[..., W:], pos)                  # [n, Sq, K]
        kv = torch.gather(rows[..., :W][:, None].expand(n, Sq, L, W), 2,
                          sel[..., None].expand(*sel.shape, W))                    # [n, Sq, K, W]
        kv = kv.reshape(n * Sq, 1, sel.shape[-1], W)
        qq = q_main.reshape(n * Sq, 1, d.heads, W).transpose(1, 2)                 # [nS, H, 1, W]
        R = d.kv_lora_rank
        if dev.type == "cpu":       # the CPU kernel takes the latent values as they are
            o = self.attention_op(qq, kv, kv[..., :R], self.scale, count.reshape(-1))
        else:
            o = self.attention_op(qq, kv, kv, self.scale, count.reshape(-1))[..., :R]
        if self.index_hook is not None:
            self.index_hook(layer, sel.reshape(n * Sq, -1), count.reshape(-1))
        return o.reshape(n, Sq, d.heads, R)

    def _select(self, qi, wt, ki, pos):
        """Each query's selected key positions ``[n, Sq, K]`` (ascending; entries past its
        ``count`` are 0 and never read) and ``count [n, Sq]``, K = min(index_topk, L)."""
        n, Sq, Hi, Di = qi.shape
        L = ki.shape[1]
        K, dev = min(self.index.topk, L), ki.device
        scale = torch.tensor(Di ** -0.5, dtype=torch.float32, device=dev)
        kf = ki.float()                                                            # [n, L, Di]
        score = torch.empty((n, Sq, L), dtype=torch.float32, device=dev)
        step = max(1, _SCORE_CHUNK // max(1, Hi * L * Di))
        for a in range(0, Sq, step):
            qf = qi[:, a:a + step].float()                                         # [n, s, Hi, Di]
            s = torch.relu(dot8(qf[:, :, :, None, :], kf[:, None, None]) * scale)  # [n, s, Hi, L]
            acc = torch.zeros(s.shape[:2] + (L,), dtype=torch.float32, device=dev)
            for h in range(Hi):
                acc = acc + wt[:, a:a + step, h, None] * s[:, :, h]
            score[:, a:a + step] = acc
        visible = torch.arange(L, device=dev)[None, None, :] <= pos[..., None]
        score = torch.where(visible, score, float("-inf"))
        order = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :K]
        count = (pos + 1).clamp(max=K)
        keep = torch.arange(K, device=dev)[None, None, :] < count[..., None]
        sel = torch.sort(torch.where(keep, order, L), dim=-1).values
        return torch.where(sel < L, sel, 0), count
