"""The FP8 KV format on the hybrids' full-attention layers (Qwen3-Next, Qwen3.5 dense and MoE,
Nemotron-H dense and MoE), trainer side, no engine.

A hybrid's cache rows are its full-attention layers' ``[K | V]`` (the GQA ``KVFormat``); its
linear layers (Gated DeltaNet, Mamba-2) keep a recurrent state instead. With ``kv_cache="fp8"``:

- a row is stored as ``2·Hkv·D`` E4M3 bytes (half of bf16's), and what a slot holds read back
  (``decode(encode(.))``, the engine's paged write and read) is torch's own E4M3 cast of
  ``x / scale`` times the scale — the trainer's ``roundtrip``, bit for bit;
- the format acts on the attention layers and only there: per-layer scales of the linear layers
  change nothing in the forward, the attention layer's scale does, and the fp8 forward differs
  from the bf16-cache one.

The engine side (a real vLLM CPU engine against this trainer): tests/e2e/test_qwen3_5_vllm.py,
tests/e2e/test_nemotron_h_vllm.py (opt-in ``SKYRL_NUMERICS_HYBRID_ALL=1``).
"""
from __future__ import annotations

import re

import pytest
import torch

from skyrl_numerics.errors import InputError
from skyrl_numerics.invariant import from_checkpoint
from skyrl_numerics.models import build_tiny_model

FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "nemotron_h", "nemotron_h_moe")


@pytest.fixture(scope="module")
def dirs():
    return {f: build_tiny_model(f) for f in FAMILIES}


def _attention_layers(model) -> list[int]:
    """The full-attention layers: those with an ``o_proj`` (the linear mixers have ``out_proj``)."""
    return sorted({int(m.group(1)) for n in model.hf_names()
                   if (m := re.search(r"layers\.(\d+)\..*\bo_proj\.weight$", n))})


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(2, 512, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_rows_of_the_attention_layers_are_what_the_paged_cache_holds(dirs, family):
    m8, m = from_checkpoint(dirs[family], kv_cache="fp8"), from_checkpoint(dirs[family])
    layers = _attention_layers(m8)
    assert layers and len(layers) < m8.kv.layers, layers     # a hybrid: some layers, not all
    a = m8.attn_dims
    width = 2 * a.kv_heads * a.head_dim
    assert m8.kv.width == width and m8.kv.row_bytes == width and m.kv.row_bytes == 2 * width
    rows = (torch.randn(11, width, generator=torch.Generator().manual_seed(1)) * 40
            ).to(torch.bfloat16)
    for i in layers:
        stored = m8.kv.encode(i, rows)
        assert stored.dtype == torch.uint8 and tuple(stored.shape) == (11, width)
        back = m8.kv.decode(i, stored)
        ref = rows.float().to(torch.float8_e4m3fn).float().to(torch.bfloat16)  # scale 1
        assert torch.equal(back, ref) and torch.equal(m8.kv.roundtrip(i, rows), ref)
        assert not torch.equal(back, rows)                   # it really quantizes


@pytest.mark.parametrize("family", FAMILIES)
def test_the_fp8_format_acts_on_the_attention_layers_only(dirs, family):
    """Per-layer ``k_scale`` lists (one entry per layer, as vLLM's per-layer scales): changing the
    linear layers' entries leaves the forward's bits alone, changing an attention layer's entry
    moves them, and fp8 differs from the bf16 cache."""
    d = dirs[family]
    n_layers = from_checkpoint(d).kv.layers
    attn = _attention_layers(from_checkpoint(d))
    ids = _ids(40, 3)

    def hidden(k_scale):
        spec = {"format": "fp8", "k_scale": k_scale, "v_scale": 1.0}
        with torch.no_grad():
            return from_checkpoint(d, kv_cache=spec).sequence_hidden(ids)

    ones = hidden([1.0] * n_layers)
    linear_scaled = hidden([1.0 if i in attn else 3.0 for i in range(n_layers)])
    attn_scaled = hidden([0.37 if i in attn else 1.0 for i in range(n_layers)])
    assert torch.equal(ones, linear_scaled)
    assert not torch.equal(ones, attn_scaled)
    with torch.no_grad():
        assert not torch.equal(ones, from_checkpoint(d).sequence_hidden(ids))


def test_a_scale_list_of_the_wrong_length_is_refused_naming_the_field(dirs):
    d = dirs["nemotron_h"]
    m = from_checkpoint(d, kv_cache={"format": "fp8", "k_scale": [1.0]})
    with pytest.raises(InputError) as e:
        with torch.no_grad():
            m.sequence_hidden(_ids(8, 0))
    assert e.value.field == "kv_cache.k_scale"
