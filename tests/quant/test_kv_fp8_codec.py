"""FP8 KV-cache simulation: hand vectors, layout of the 656-byte fp8_ds_mla row, and agreement of
the MLA latent cache with the per-element fp8 formula."""
import pytest
import torch

from skyrl_numerics.errors import InputError
from skyrl_numerics.quant import codecs as C
from skyrl_numerics.quant.kv_fp8_codec import (ds_mla_cache_read, ds_mla_cache_write, fp8_kv_read, fp8_kv_roundtrip,
                                     fp8_kv_write, mla_cache_read, mla_cache_write)


def test_fp8_kv_hand_vectors():
    x = torch.tensor([1.0, 0.3, -1000.0, float("inf"), float("nan"), 0.0], dtype=torch.bfloat16)
    codes = fp8_kv_write(x, 0.5)
    # 1/0.5 = 2 (0x40); 0.3 -> bf16 0.30078125 / 0.5 = 0.6015625 -> e4m3 0.625 (0x32);
    # -2000 saturates to -448 (0xFE); inf saturates (0x7E); NaN -> 0x7F; 0 -> 0
    assert codes.tolist() == [0x40, 0x32, 0xFE, 0x7E, 0x7F, 0x00]
    back = fp8_kv_read(codes, 0.5)
    assert back[:4].tolist() == [1.0, 0.3125, -224.0, 224.0] and torch.isnan(back[4])
    assert fp8_kv_roundtrip(x, 0.5).dtype == torch.bfloat16
    with pytest.raises(InputError, match="k_scale"):
        fp8_kv_write(x, 0.0)


def test_mla_latent_uses_one_scale_for_kv_c_and_k_pe():
    g = torch.Generator().manual_seed(0)
    kv_c = torch.randn(5, 32, generator=g, dtype=torch.float32).bfloat16()
    k_pe = (torch.randn(5, 16, generator=g) * 3).bfloat16()
    row = mla_cache_write(kv_c, k_pe, 0.02)
    assert row.shape == (5, 48) and row.dtype == torch.uint8
    a, b = mla_cache_read(row, 0.02, 32)
    assert torch.equal(a, C.round_to(kv_c.float() / 0.02, "e4m3fn") * 0.02)
    assert torch.equal(b, C.round_to(k_pe.float() / 0.02, "e4m3fn") * 0.02)


def test_ds_mla_layout_and_roundtrip():
    g = torch.Generator().manual_seed(1)
    kv_c = (torch.randn(3, 512, generator=g) * torch.tensor([1.0, 10.0, 0.01, 100.0]).repeat_interleave(128)).bfloat16()
    kv_c[2, :128] = 0                                        # an all-zero tile: scale FLT_MIN
    k_pe = torch.randn(3, 64, generator=g).bfloat16()
    rows = ds_mla_cache_write(kv_c, k_pe)
    assert rows.shape == (3, 656)
    scales = rows[:, 512:528].contiguous().view(torch.float32)
    amax = kv_c.float().reshape(3, 4, 128).abs().amax(-1)
    assert torch.equal(scales, torch.clamp(amax / 448.0, min=torch.finfo(torch.float32).tiny))
    assert torch.equal(rows[:, 528:].contiguous().view(torch.bfloat16), k_pe)   # rope verbatim
    a, pe = ds_mla_cache_read(rows)
    assert torch.equal(pe, k_pe)
    expect = (C.round_to(kv_c.float().reshape(3, 4, 128) / scales.unsqueeze(-1), "e4m3fn")
              * scales.unsqueeze(-1)).reshape(3, 512)
    assert torch.equal(a, expect) and (a[2, :128] == 0).all()
    # the tile max maps to 448 exactly (amax/448 then x/s), so the max element survives to ~1 ulp
    rel = ((a - kv_c.float()).abs() / kv_c.float().abs().clamp(min=1e-30))[kv_c.float() != 0]
    assert float(rel.max()) <= 2 ** -4 + 1e-6
    with pytest.raises(InputError):
        ds_mla_cache_write(kv_c[:, :256], k_pe)


@pytest.mark.parametrize("scale", [1.0, 0.5, 0.37, 3.1e-3, 17.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lookup", ["compiled", "torch"])
def test_fp8_kv_read_table_is_the_formula_for_every_code(scale, dtype, lookup, monkeypatch):
    """The read's 256-entry table gives, code for code, ``(decode(code) * k_scale).to(dtype)``
    computed element by element (NaN codes 0x7F / 0xFF included, bit for bit), for any layout —
    through the compiled lookup (numba) and through the torch gather (its fallback)."""
    from skyrl_numerics.quant import kv_fp8_codec as Q

    if lookup == "compiled":
        assert Q._take() is not None            # numba is installed here (the Makefile's deps)
        monkeypatch.setattr(Q, "_TAKE_MIN", 0)
    else:
        monkeypatch.setenv("SKYRL_NUMERICS_NUMBA", "0")
        assert Q._take() is None
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = (C.decode(codes, C.E4M3) * torch.tensor(scale)).to(dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    got = fp8_kv_read(codes, scale, dtype)
    assert got.dtype == dtype and torch.equal(got.view(bits), want.view(bits))
    grid = codes.view(16, 16)
    got = fp8_kv_read(grid.t()[2:9], torch.tensor(scale), dtype)          # a strided view
    assert torch.equal(got.view(bits), want.view(16, 16).t()[2:9].contiguous().view(bits))
    big = torch.randint(0, 256, (3, 50, 70), dtype=torch.uint8)          # a cache-sized read
    got = fp8_kv_read(big[:, ::2], scale, dtype)
    assert got.shape == (3, 25, 70)
    assert torch.equal(got.view(bits), want[big[:, ::2].long()].view(bits))
