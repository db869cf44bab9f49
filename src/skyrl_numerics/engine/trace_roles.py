"""Where each traced tensor lives, per family and per side: the canonical names the tracer aligns
the sides by (``skyrl_numerics.doctor.trace``), and the hooks that hand those tensors to a
:class:`~.trace_capture.TraceRecorder`.

A canonical name is ``embed``, ``L<i>.<role>`` (layer ``i``) or ``norm`` / ``logits``, in forward
order (:func:`canonical_order`). Roles of a layer (``per_op`` adds all but ``layer``):

========================  ===================================================================
``attn_norm``             the attention input (``input_layernorm`` output)
``q`` ``k`` ``v``         the q / k / v projections (before q/k norm and RoPE; GQA families)
``q`` ``kv_a``            MLA: ``q_b_proj`` (or ``q_proj``) output, ``kv_a_proj_with_mqa`` output
``attn_core``             the attention output before ``o_proj`` (``o_proj``'s input)
``attn``                  ``o_proj``'s output (what the attention adds to the residual stream)
``mlp_norm``              the MLP / MoE input (``post_attention_layernorm`` output)
``router_logits``         the MoE router's logits (``mlp.gate``)
``router_ids``            the experts it chose (HF and the invariant forward)
``mlp``                   the MLP / MoE block output (routed + shared experts)
``layer``                 the residual stream after the layer
========================  ===================================================================

Module paths (one table, :data:`MODULES`; ``{i}``: the layer; a ``what`` of ``out`` is the
module's (first) output, ``in`` its first input, ``ids`` the third output of an HF router,
``sum`` vLLM's ``(hidden, residual)`` pair added in the model dtype — the residual stream HF
holds after the layer — and ``cols:<a>:<b>`` a column slice of a fused projection's output)::

    role           HF (transformers)                 vLLM
    embed          model.embed_tokens                model.embed_tokens
    attn_norm      layers.{i}.input_layernorm        layers.{i}.input_layernorm
    q / k / v      self_attn.{q,k,v}_proj            self_attn.qkv_proj, cols
    q (MLA)        self_attn.q_b_proj | q_proj       self_attn.q_b_proj | q_proj
    kv_a (MLA)     self_attn.kv_a_proj_with_mqa      fused_qkv_a_proj cols | kv_a_proj_with_mqa
    attn_core      self_attn.o_proj (in)             self_attn.o_proj (in)
    attn           self_attn.o_proj                  self_attn.o_proj
    mlp_norm       post_attention_layernorm          post_attention_layernorm
    router_logits  mlp.gate                          mlp.gate
    router_ids     mlp.gate (ids)                    - (vLLM's fused MoE picks them inside)
    mlp            mlp                               mlp
    layer          layers.{i}                        layers.{i} (sum)
    norm           model.norm                        model.norm
    logits         lm_head                           logits_processor (sampled rows only)

The invariant forward (trainer and the batch-invariant engine) has no submodules: its methods
are wrapped instead (:func:`hook_invariant`): ``embed``, ``attention`` (input: ``attn_norm``,
output: ``attn``), ``ffn`` (``mlp_norm`` / ``mlp``), ``_route`` (``router_ids``),
``forward_tokens`` (``norm``) and ``logits``; ``layer`` is the residual stream it adds up the
same way (``h + attention``, then ``+ ffn``, in the model dtype). What a side cannot reach (the
invariant forward's q/k/v and router logits, vLLM's router ids, per-expert projections inside
fused MoE kernels on every side) is simply absent there: the comparator lists it as one-sided.
"""
from __future__ import annotations

from typing import Callable

LAYER_ROLES = ("attn_norm", "q", "kv_a", "k", "v", "attn_core", "attn", "mlp_norm",
               "router_logits", "router_ids", "mlp", "layer")

_GQA_HF = {"q": ("self_attn.q_proj", "out"), "k": ("self_attn.k_proj", "out"),
           "v": ("self_attn.v_proj", "out")}
_GQA_VLLM = {"q": ("self_attn.qkv_proj", "cols:0:q"), "k": ("self_attn.qkv_proj", "cols:q:q+kv"),
             "v": ("self_attn.qkv_proj", "cols:q+kv:q+2kv")}
_MLA_HF = {"q": ("self_attn.q_b_proj|self_attn.q_proj", "out"),
           "kv_a": ("self_attn.kv_a_proj_with_mqa", "out")}
_MLA_VLLM = {"q": ("self_attn.q_b_proj|self_attn.q_proj", "out"),
             "kv_a": ("self_attn.fused_qkv_a_proj|self_attn.kv_a_proj_with_mqa",
                      "cols:qa:|out")}
_COMMON = {"attn_norm": ("input_layernorm", "out"), "attn_core": ("self_attn.o_proj", "in"),
           "attn": ("self_attn.o_proj", "out"), "mlp_norm": ("post_attention_layernorm", "out"),
           "router_logits": ("mlp.gate", "out"), "mlp": ("mlp", "out")}

#: side kind -> attention kind -> role -> (module path(s) under ``model.layers.{i}``, what)
MODULES = {
    "hf": {"gqa": {**_COMMON, **_GQA_HF, "router_ids": ("mlp.gate", "ids"), "layer": ("", "out")},
           "mla": {**_COMMON, **_MLA_HF, "router_ids": ("mlp.gate", "ids"),
                   "layer": ("", "out")}},
    "vllm": {"gqa": {**_COMMON, **_GQA_VLLM, "layer": ("", "sum")},
             "mla": {**_COMMON, **_MLA_VLLM, "layer": ("", "sum")}},
}
#: side kind -> model-level role -> (module path, what)
TOP = {"hf": {"embed": ("model.embed_tokens", "out"), "norm": ("model.norm", "out"),
              "logits": ("lm_head", "out")},
       "vllm": {"embed": ("model.embed_tokens", "out"), "norm": ("model.norm", "out"),
                "logits": ("logits_processor", "out")}}


def canonical_order(num_layers: int, per_op: bool) -> list[str]:
    """Every canonical name in forward order (``per_op=False``: embed, each layer, norm, logits)."""
    roles = LAYER_ROLES if per_op else ("layer",)
    return (["embed"] + [f"L{i}.{r}" for i in range(num_layers) for r in roles]
            + ["norm", "logits"])


def attention_kind(cfg) -> str:
    """``mla`` for a config with a latent KV (``kv_lora_rank``), else ``gqa``."""
    return "mla" if getattr(cfg, "kv_lora_rank", None) else "gqa"


def _sizes(cfg) -> dict:
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv = (getattr(cfg, "num_key_value_heads", None) or heads) * head_dim
    return {"q": heads * head_dim, "kv": kv, "qa": getattr(cfg, "q_lora_rank", None) or 0}


def _bound(expr: str, sizes: dict) -> int | None:
    """``"q+2kv"`` -> q + 2·kv from ``sizes``; ``""`` -> None (to the end)."""
    if not expr:
        return None
    total = 0
    for term in expr.split("+"):
        num = "".join(c for c in term if c.isdigit())
        name = term[len(num):]
        total += (int(num) if num else 1) * (sizes[name] if name else 1)
    return total


def _first(x):
    while isinstance(x, (tuple, list)):
        x = x[0]
    return x


def _select(what: str, args, out, sizes: dict):
    """The tensor a hook keeps (see the module's table), or None when the module has none."""
    if what == "in":
        return _first(args) if args else None
    if what == "ids":
        return out[2] if isinstance(out, (tuple, list)) and len(out) > 2 else None
    if what == "sum":
        if isinstance(out, (tuple, list)) and len(out) > 1 and out[1] is not None:
            return out[0] + out[1]
        return _first(out)
    if what.startswith("cols:"):
        _, a, b = what.split(":")
        t = _first(out)
        return t[..., _bound(a, sizes) or 0:_bound(b, sizes)]
    return _first(out)


def _resolve(model, path: str):
    mod = model
    for part in path.split(".") if path else ():
        mod = getattr(mod, part, None)
        if mod is None:
            return None
    return mod


def hook_modules(model, kind: str, cfg, record: Callable, per_op: bool) -> Callable[[], None]:
    """Forward hooks on an HF (``kind="hf"``) or vLLM (``"vllm"``) model: each canonical tensor
    goes to ``record(name, tensor)``. Returns the function that removes them."""
    sizes, table = _sizes(cfg), MODULES[kind][attention_kind(cfg)]
    roles = LAYER_ROLES if per_op else ("layer",)
    handles = []

    def add(mod, name: str, what: str):
        if what == "in":
            handles.append(mod.register_forward_pre_hook(
                lambda m, args, _n=name: record(_n, _select("in", args, None, sizes))))
        else:
            handles.append(mod.register_forward_hook(
                lambda m, args, out, _n=name, _w=what: record(_n, _select(_w, args, out, sizes))))

    for name, (path, what) in TOP[kind].items():
        mod = _resolve(model, path)
        if mod is not None:
            add(mod, name, what)
    layers = _resolve(model, "model.layers")
    for i, layer in enumerate(layers if layers is not None else ()):
        for role in roles:
            if role not in table:
                continue
            paths, whats = table[role][0].split("|"), table[role][1].split("|")
            for j, path in enumerate(paths):   # the first path this model has
                mod = _resolve(layer, path)
                if mod is not None:
                    add(mod, f"L{i}.{role}", whats[min(j, len(whats) - 1)])
                    break
    return lambda: [h.remove() for h in handles]


def hook_invariant(core, record: Callable, per_op: bool) -> Callable[[], None]:
    """Wrap the invariant forward's methods on this instance (see the module); returns the
    function that restores them. ``record(name, tensor)`` as in :func:`hook_modules`."""
    state = {"h": None, "layer": 0}
    orig = {n: getattr(core, n) for n in ("embed", "attention", "ffn", "forward_tokens",
                                          "logits", "_route")}

    def embed(ids):
        h = orig["embed"](ids)
        state["h"] = h
        record("embed", h)
        return h

    def attention(i, x, positions, attend):
        out = orig["attention"](i, x, positions, attend)
        if per_op:
            record(f"L{i}.attn_norm", x)
            record(f"L{i}.attn", out)
        state["h"] = state["h"] + out
        return out

    def ffn(i, x):
        state["layer"] = i
        out = orig["ffn"](i, x)
        if per_op:
            record(f"L{i}.mlp_norm", x)
            record(f"L{i}.mlp", out)
        state["h"] = state["h"] + out
        record(f"L{i}.layer", state["h"])
        return out

    def route(j, ids):
        if per_op:   # j counts MoE layers; ffn noted the layer it runs
            record(f"L{state['layer']}.router_ids", ids)
        return orig["_route"](j, ids)

    def forward_tokens(input_ids, positions, attend):
        out = orig["forward_tokens"](input_ids, positions, attend)
        record("norm", out)
        return out

    def logits(hidden):
        out = orig["logits"](hidden)
        record("logits", out)
        return out

    for n, f in (("embed", embed), ("attention", attention), ("ffn", ffn), ("_route", route),
                 ("forward_tokens", forward_tokens), ("logits", logits)):
        setattr(core, n, f)

    def unhook():
        for n in orig:
            core.__dict__.pop(n, None)
    return unhook
