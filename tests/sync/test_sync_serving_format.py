"""Weight sync in serving formats: the publisher quantizes bf16 weights at publish time (FP8 E4M3
128x128 blocks as DeepSeek-V3 / compressed-tensors store them, INT4 pack-quantized, NVFP4), the
receiver reconstructs the serving tensors bit for bit from deltas over codes and scales, the format
is a digested manifest field, and bad serving tensors are refused before anything is committed."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from skyrl_numerics.errors import InputError
from skyrl_numerics.quant import quantize
from skyrl_numerics.quant.recipes_int4 import pack_int4_to_int32
from skyrl_numerics.sync.codec import tensor_bytes
from skyrl_numerics.sync.serving import check_serving_tensors, serving_state
from skyrl_numerics.sync.manifest import manifest_path, seal
from skyrl_numerics.sync.weight_sync import DeltaPublisher, DeltaReceiver


def raw(t: torch.Tensor) -> bytes:
    return tensor_bytes(t.contiguous()).tobytes()


def make_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g) * 0.02).bfloat16()
    return {
        "model.embed_tokens.weight": r(64, 128),
        "model.layers.0.input_layernorm.weight": torch.ones(128, dtype=torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": r(256, 128),
        "model.layers.0.self_attn.o_proj.weight": r(128, 256),
        "model.layers.0.mlp.gate.weight": r(8, 128),
        "model.layers.0.mlp.experts.0.gate_proj.weight": r(64, 128),
        "model.layers.0.mlp.experts.gate_up_proj": r(4, 128, 128),    # fused 3-D stack
        "lm_head.weight": r(64, 128),
    }


RAGGED = "model.layers.0.self_attn.k_proj.weight"   # 200 x 136: partial 128x128 blocks (fp8 only)
QUANTIZED = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight",
             "model.layers.0.mlp.experts.0.gate_proj.weight", "model.layers.0.mlp.experts.gate_up_proj")


def step(state, seed, frac=0.02):
    """A small optimizer-like step: ``frac`` of each tensor's elements move by one or two ulps."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in state.items():
        flat = t.clone().reshape(-1)
        idx = torch.randperm(flat.numel(), generator=g)[: max(1, int(frac * flat.numel()))]
        bits = flat.view(torch.int16)
        bits[idx] += torch.randint(1, 3, (idx.numel(),), generator=g, dtype=torch.int16)
        out[k] = flat.reshape(t.shape)
    return out


def expected(name: str, w: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """The serving tensors of one weight, computed here straight from ``quant.quantize``."""
    mats = [w] if w.dim() == 2 else list(w)
    sfx = "" if w.dim() == 2 else ""
    del sfx
    out: dict[str, list] = {}

    def put(k, v):
        out.setdefault(k, []).append(v)
    for m in mats:
        if fmt == "deepseek_fp8":
            q = quantize(m, "fp8_block", block=(128, 128))
            put(name, q.codes), put(name + "_scale_inv", q.scales)
        elif fmt == "ct_fp8_block":
            q = quantize(m, "fp8_channel", block=(128, 128), scale_dtype=m.dtype)
            put(name, q.codes), put(name + "_scale", q.scales)
        elif fmt == "ct_int4":
            q = quantize(m, "int4_g32")
            put(name + "_packed", pack_int4_to_int32(q.codes)), put(name + "_scale", q.scales)
        elif fmt == "ct_nvfp4":
            q = quantize(m, "nvfp4", convention="compressed_tensors")
            put(name + "_packed", q.codes), put(name + "_scale", q.scales)
            put(name + "_global_scale", q.global_scale.reshape(1) if w.dim() == 2 else q.global_scale.reshape(()))
    res = {k: (v[0] if w.dim() == 2 else torch.stack(v)) for k, v in out.items()}
    if fmt == "ct_int4":
        res[name + "_shape"] = torch.tensor(list(w.shape), dtype=torch.int64)
    return res


FORMATS = ["deepseek_fp8", "ct_fp8_block", "ct_int4", "ct_nvfp4"]


def with_ragged(state, fmt, seed=0):
    if fmt in ("deepseek_fp8", "ct_fp8_block"):
        g = torch.Generator().manual_seed(seed + 100)
        state = dict(state, **{RAGGED: (torch.randn(200, 136, generator=g) * 0.02).bfloat16()})
    return state


@pytest.mark.parametrize("fmt", FORMATS)
def test_receiver_holds_quantize_bit_for_bit_over_deltas(tmp_path, fmt):
    states = [with_ragged(make_state(), fmt)]
    for s in range(3):
        states.append(step(states[-1], s))
    pub = DeltaPublisher(tmp_path, weights_format=fmt)
    rec = DeltaReceiver(tmp_path, weights_format=fmt)
    for v, st in enumerate(states):
        m = pub.publish(st)
        assert m.weights_format == fmt and (m.is_full == (v == 0))
        if v:
            assert m.filters[0] == "xor"
        assert rec.sync()[-1].version == v
        held = rec.state
        names = QUANTIZED + ((RAGGED,) if RAGGED in st else ())
        assert sorted(pub.last_quantized) == sorted(names)
        want = {}
        for n in names:
            want.update(expected(n, st[n], fmt))
        for n, t in st.items():
            if n not in names:
                want[n] = t
        assert set(held) == set(want)
        for n, t in want.items():
            assert held[n].dtype == t.dtype and tuple(held[n].shape) == tuple(t.shape), n
            assert raw(held[n]) == raw(t), n
        assert sorted(check_serving_tensors(held, fmt)) == sorted(names)


@pytest.mark.parametrize("fmt", ["deepseek_fp8", "ct_int4"])
def test_deltas_are_over_codes_and_scales(tmp_path, fmt):
    s0 = make_state()
    pub = DeltaPublisher(tmp_path, weights_format=fmt)
    full = pub.publish(s0)
    # an unchanged step: no payload at all
    same = pub.publish({k: v.clone() for k, v in s0.items()})
    assert same.changed == [] and same.payload_nbytes == 0
    d = pub.publish(step(s0, 1, frac=0.01))
    assert 0 < d.payload_nbytes < full.payload_nbytes / 5
    by = {e.name: e for e in d.tensors}
    # norms were not touched by the step? they were (every tensor moves): their payload exists too
    assert by["model.layers.0.input_layernorm.weight"].dtype == "bfloat16"
    code = "model.layers.0.self_attn.q_proj.weight" + ("" if fmt == "deepseek_fp8" else "_packed")
    assert by[code].dtype == ("float8_e4m3fn" if fmt == "deepseek_fp8" else "int32")


def test_fp8_payload_bytes_smaller_than_bf16(tmp_path):
    s0 = make_state()
    s1 = step(s0, 1, frac=0.03)
    sizes = {}
    for fmt in ("native", "deepseek_fp8"):
        pub = DeltaPublisher(tmp_path / fmt, weights_format=fmt)
        sizes[fmt] = (pub.publish(s0).payload_nbytes, pub.publish(s1).payload_nbytes)
    assert sizes["deepseek_fp8"][0] < sizes["native"][0]
    assert sizes["deepseek_fp8"][1] < sizes["native"][1]


def test_receiver_refuses_other_format(tmp_path):
    DeltaPublisher(tmp_path / "fp8", weights_format="deepseek_fp8").publish(make_state())
    DeltaPublisher(tmp_path / "bf16").publish(make_state())
    with pytest.raises(InputError) as ei:
        DeltaReceiver(tmp_path / "fp8").sync()              # expects native (bf16)
    assert ei.value.field == "weights_format" and "deepseek_fp8" in str(ei.value)
    rec = DeltaReceiver(tmp_path / "bf16", weights_format="deepseek_fp8")
    with pytest.raises(InputError) as ei:
        rec.sync()
    assert ei.value.field == "weights_format" and "'native'" in str(ei.value)
    assert rec.version is None and rec.state == {}
    rec2 = DeltaReceiver(tmp_path / "fp8", weights_format="ct_fp8_block")
    with pytest.raises(InputError, match="weights_format"):
        rec2.sync()


def test_format_field_is_digested_and_signed(tmp_path):
    DeltaPublisher(tmp_path, weights_format="deepseek_fp8", key="k").publish(make_state())
    p = tmp_path / manifest_path(0)
    d = json.loads(p.read_text())
    assert d["weights_format"] == "deepseek_fp8" and d["format_version"] == 2
    d["weights_format"] = "native"
    p.write_text(json.dumps(d))
    with pytest.raises(InputError) as ei:
        DeltaReceiver(tmp_path, key="k").sync()
    assert ei.value.field == "manifest_digest"
    p.write_text(json.dumps(seal(d)))                          # digest recomputed, no key
    with pytest.raises(InputError) as ei:
        DeltaReceiver(tmp_path, key="k").sync()
    assert ei.value.field == "signature"


def test_manifest_without_format_field_is_native(tmp_path):
    st = make_state()
    DeltaPublisher(tmp_path).publish(st)
    p = tmp_path / manifest_path(0)
    d = json.loads(p.read_text())
    del d["weights_format"]
    p.write_text(json.dumps(seal(d)))
    rec = DeltaReceiver(tmp_path)
    rec.sync()
    assert raw(rec.state["lm_head.weight"]) == raw(st["lm_head.weight"])
    d["weights_format"] = "fp7"
    p.write_text(json.dumps(seal(d)))
    with pytest.raises(InputError) as ei:
        DeltaReceiver(tmp_path).sync()
    assert ei.value.field == "weights_format"


def test_publisher_bad_input(tmp_path):
    with pytest.raises(InputError) as ei:
        DeltaPublisher(tmp_path, weights_format="fp8")
    assert ei.value.field == "weights_format"
    st = make_state()
    bad = dict(st)
    w = bad["model.layers.0.self_attn.q_proj.weight"].clone()
    w[3, 5] = float("nan")
    bad["model.layers.0.self_attn.q_proj.weight"] = w
    pub = DeltaPublisher(tmp_path, weights_format="deepseek_fp8")
    with pytest.raises(InputError) as ei:
        pub.publish(bad)
    assert ei.value.field == "model.layers.0.self_attn.q_proj.weight" and "non-finite" in str(ei.value)
    assert not (tmp_path / manifest_path(0)).exists()
    with pytest.raises(InputError) as ei:
        DeltaPublisher(tmp_path, weights_format="ct_int4", quantize=["nothing.*"]).publish(st)
    assert ei.value.field == "quantize"
    # patterns choose what is quantized
    pub = DeltaPublisher(tmp_path / "p", weights_format="ct_int4", quantize=["*.self_attn.*"])
    pub.publish(st)
    assert sorted(pub.last_quantized) == sorted(n for n in st if ".self_attn." in n)


def _forge(tmp_path, tensors, fmt):
    """Publish ``tensors`` natively, then relabel the manifest as ``fmt`` (digest recomputed, no
    key): what a writer of the store could do. The receiver's structure check must refuse it."""
    DeltaPublisher(tmp_path).publish(tensors)
    p = tmp_path / manifest_path(0)
    d = json.loads(p.read_text())
    d["weights_format"] = fmt
    p.write_text(json.dumps(seal(d)))


def _good(fmt):
    st, _ = serving_state(make_state(), fmt)
    return st


Q = "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize("case,fmt,edit,field", [
    ("scale shape", "deepseek_fp8", lambda s: s.update({Q + "_scale_inv": torch.ones(3, 1)}), Q + "_scale_inv"),
    ("scale dtype", "deepseek_fp8", lambda s: s.update({Q + "_scale_inv": s[Q + "_scale_inv"].half()}),
     Q + "_scale_inv"),
    ("nan scale", "deepseek_fp8", lambda s: s[Q + "_scale_inv"].view(-1).__setitem__(1, float("nan")), Q + "_scale_inv"),
    ("inf scale", "ct_fp8_block", lambda s: s[Q + "_scale"].view(-1).__setitem__(0, float("inf")), Q + "_scale"),
    ("codes without scales", "deepseek_fp8", lambda s: s.pop(Q + "_scale_inv"), Q),
    ("packed wrong length", "ct_int4", lambda s: s.update({Q + "_packed": s[Q + "_packed"][:, :-1].contiguous()}),
     Q + "_packed"),
    ("int4 shape mismatch", "ct_int4", lambda s: s.update({Q + "_shape": torch.tensor([256, 64])}), Q + "_packed"),
    ("int4 scale group", "ct_int4", lambda s: s.update({Q + "_scale": s[Q + "_scale"][:, :2].contiguous()}),
     Q + "_scale"),
    ("nvfp4 global missing", "ct_nvfp4", lambda s: s.pop(Q + "_global_scale"), Q + "_scale"),
    ("nvfp4 nan block scale", "ct_nvfp4",
     lambda s: s[Q + "_scale"].view(torch.uint8).view(-1).__setitem__(0, 0x7F), Q + "_scale"),
    ("nvfp4 global dtype", "ct_nvfp4", lambda s: s.update({Q + "_global_scale": s[Q + "_global_scale"].double()}),
     Q + "_global_scale"),
])
def test_receiver_refuses_bad_serving_tensors(tmp_path, case, fmt, edit, field):
    st = _good(fmt)
    st = {k: v.clone() for k, v in st.items()}
    edit(st)
    _forge(tmp_path, st, fmt)
    rec = DeltaReceiver(tmp_path, weights_format=fmt)
    with pytest.raises(InputError) as ei:
        rec.sync()
    assert ei.value.field == field, (case, str(ei.value))
    assert rec.version is None and rec.state == {}


def test_bad_delta_keeps_last_good_weights(tmp_path):
    """A forged delta whose scales turn NaN is refused and the held serving tensors stay."""
    fmt = "deepseek_fp8"
    good = _good(fmt)
    pub = DeltaPublisher(tmp_path)          # native publisher writing serving tensors, relabelled
    pub.publish(good)
    p = tmp_path / manifest_path(0)
    d = json.loads(p.read_text())
    d["weights_format"] = fmt
    p.write_text(json.dumps(seal(d)))
    rec = DeltaReceiver(tmp_path, weights_format=fmt)
    rec.sync()
    before = {k: raw(v) for k, v in rec.state.items()}
    bad = {k: v.clone() for k, v in good.items()}
    bad[Q + "_scale_inv"].view(-1)[0] = float("inf")
    pub.publish(bad)
    p = tmp_path / manifest_path(1)
    d = json.loads(p.read_text())
    d["weights_format"] = fmt
    p.write_text(json.dumps(seal(d)))
    with pytest.raises(InputError) as ei:
        rec.sync()
    assert ei.value.field == Q + "_scale_inv"
    assert rec.version == 0 and {k: raw(v) for k, v in rec.state.items()} == before


def test_serving_state_is_checkpoint_writer_bitwise(tmp_path):
    """The published tensors are what quant.checkpoint writes for a checkpoint in that format."""
    from safetensors.torch import load_file, save_file

    from skyrl_numerics.quant.checkpoint import write_quantized_checkpoint

    st = make_state()
    src = tmp_path / "src"
    src.mkdir()
    save_file({k: v.contiguous() for k, v in st.items()}, str(src / "model.safetensors"))
    (src / "config.json").write_text("{}")
    served, done = serving_state(st, "ct_int4")
    write_quantized_checkpoint(src, tmp_path / "q", "ct_int4", lambda n: n in done)
    disk = load_file(str(tmp_path / "q" / "model.safetensors"))
    assert set(disk) == set(served)
    assert all(raw(disk[k]) == raw(served[k]) for k in disk)
    assert np.array_equal(disk[Q + "_shape"].numpy(), np.array([256, 128]))


@pytest.mark.parametrize("fmt", ["ct_int4_g128", "ct_fp8_channel", "modelopt_fp8", "modelopt_nvfp4"])
def test_other_formats_round_trip_over_deltas(tmp_path, fmt):
    """The remaining layouts: held tensors equal the checkpoint writer's after a delta, and pass
    the receiver's structure check (ragged shapes included)."""
    from skyrl_numerics.quant.checkpoint import quantize_weight_tensors

    g = torch.Generator().manual_seed(5)
    s0 = dict(make_state(), **{"model.layers.0.self_attn.v_proj.weight":
                               (torch.randn(40, 256, generator=g) * 0.02).bfloat16()})
    s1 = step(s0, 9)
    pub = DeltaPublisher(tmp_path, weights_format=fmt)
    rec = DeltaReceiver(tmp_path, weights_format=fmt)
    pub.publish(s0)
    assert not pub.publish(s1).is_full
    rec.sync()
    grouped = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.v_proj.weight"}
    want, _ = serving_state(s1, fmt)
    for n in pub.last_quantized:
        ref = quantize_weight_tensors(n, s1[n], fmt)
        for k, v in ref.items():
            assert raw(rec.state[k]) == raw(want[k]) and rec.state[k].dtype == v.dtype, k
            # NVFP4: q and v share their global (fused qkv), so they differ from the per-tensor writer
            assert (raw(want[k]) == raw(v)) or (fmt == "modelopt_nvfp4" and n in grouped), k
    assert sorted(check_serving_tensors(rec.state, fmt)) == sorted(pub.last_quantized)


@pytest.mark.parametrize("fmt,conv,gsfx", [("ct_nvfp4", "compressed_tensors", "_global_scale"),
                                           ("modelopt_nvfp4", "modelopt", "_scale_2")])
def test_nvfp4_fused_projections_share_one_global(fmt, conv, gsfx):
    """q/k/v and gate/up (per expert for 3-D stacks too) get one global from the group's amax,
    as modelopt's export (``preprocess_linear_fusion``: max of the members' amax) and vLLM's
    fused qkv_proj / gate_up_proj need; each member's codes and scales are then
    ``quantize(w, "nvfp4", global_amax=group amax)`` bit for bit. A projection outside any group
    (o_proj) keeps its own global."""
    from skyrl_numerics.sync.serving import fused_group

    g = torch.Generator().manual_seed(7)
    r = lambda *s, a=0.02: (torch.randn(*s, generator=g) * a).bfloat16()
    p = "model.layers.3."
    st = {p + "self_attn.q_proj.weight": r(64, 128), p + "self_attn.k_proj.weight": r(32, 128, a=0.2),
          p + "self_attn.v_proj.weight": r(32, 128), p + "self_attn.o_proj.weight": r(128, 64),
          p + "mlp.experts.1.gate_proj.weight": r(48, 128), p + "mlp.experts.1.up_proj.weight": r(48, 128, a=0.1),
          p + "mlp.experts.gate_proj": r(3, 48, 128), p + "mlp.experts.up_proj": r(3, 48, 128, a=0.07)}
    out, done = serving_state(st, fmt)
    assert sorted(done) == sorted(st)
    groups = {}
    for n in st:
        groups.setdefault(fused_group(n), []).append(n)
    assert fused_group(p + "self_attn.o_proj.weight") is None
    assert len(groups[p + "self_attn.qkv"]) == 3 and len(groups[p + "mlp.experts.1.gate_up"]) == 2
    assert len(groups[p + "mlp.experts.gate_up"]) == 2        # the two 3-D stacks, per expert
    for key, members in groups.items():
        for n in members:
            stack = st[n].dim() == 3
            amax = torch.stack([st[x].float().abs().flatten(int(stack)).amax(-1) for x in members]).amax(0)
            mats = list(st[n]) if stack else [st[n]]
            for e, m in enumerate(mats):
                ga = (amax[e] if stack else amax) if key is not None else None
                q = quantize(m, "nvfp4", convention=conv, global_amax=ga)
                code = out[n + ("_packed" if fmt == "ct_nvfp4" else "")]
                assert raw(q.codes) == raw(code[e] if stack else code), (n, e)
                assert raw(q.scales) == raw(out[n + "_scale"][e] if stack else out[n + "_scale"]), (n, e)
                glob = out[n + gsfx].reshape(-1)[e if stack else 0]
                assert raw(q.global_scale.reshape(())) == raw(glob.reshape(())), (n, e)
        if key is not None:   # one global per group (per expert)
            globs = [out[n + gsfx].reshape(-1) for n in members]
            assert all(raw(x) == raw(globs[0]) for x in globs), key
    # the k_proj amax (10x) sets the qkv global: q's own global would differ
    own = quantize(st[p + "self_attn.q_proj.weight"], "nvfp4", convention=conv).global_scale
    assert raw(own.reshape(())) != raw(out[p + "self_attn.q_proj.weight" + gsfx].reshape(()))
