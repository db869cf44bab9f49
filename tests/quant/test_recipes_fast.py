"""The fused CPU fake-quant paths (``fake_quant``) against the two-step reference
``dequantize(quantize(x))`` they replace, bit for bit: every recipe and convention, bf16 / fp16 /
float32 / float64 inputs, special values (±0, ±inf, NaN, subnormals, zero / tiny / huge
blocks, exact grid points and midpoints), static globals, chunk boundaries; plus the grid
rounding helper against ``round_to`` on every midpoint. "Bit for bit": the same bits in every
element, except that a NaN only has to be a NaN (IEEE leaves NaN payloads to the arithmetic)."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skyrl_numerics.quant import api, blocks
from skyrl_numerics.quant import codecs as C

CONFIGS = [
    ("fp8_tensor", {}), ("fp8_channel", {}), ("fp8_token", {}), ("fp8_token", {"scale_ub": 1.0}),
    ("fp8_block", {}), ("fp8_block", {"ue8m0": True}), ("fp8_block", {"block": (128, 128)}),
    ("fp8_block", {"block": (1, 64), "eps": 1e-4}),
    ("fp8_channel", {"block": (-1, -1)}), ("fp8_channel", {"block": (128, 128)}),
    ("mxfp8", {}), ("mxfp8", {"scale_mode": "rceil"}), ("mxfp8", {"elem": "e5m2"}),
    ("mxfp8", {"elem": "e5m2", "scale_mode": "rceil"}), ("mxfp4", {}), ("mxfp4", {"scale_mode": "rceil"}),
    ("int4_g32", {}), ("int4_g32", {"group": 64}),
] + [("nvfp4", {"convention": c}) for c in
     ("vllm", "te", "modelopt", "torchao", "compressed_tensors", "modelopt<0.45", "torchao<0.17")] + [
    ("nvfp4", {"convention": "vllm", "tile": (16, 16)}), ("nvfp4", {"convention": "modelopt", "tile": (16, 16)}),
    ("nvfp4", {"convention": "vllm", "global_amax": 3.0}), ("nvfp4", {"convention": "torchao", "global_scale": 1e-3}),
    ("nvfp4", {"convention": "compressed_tensors", "stats_dtype": torch.bfloat16}),
    ("int4_g32_kimi", {}), ("fp8_block", {"convention": "skyrl"}),
    ("fp8_block", {"convention": "skyrl", "ue8m0": True, "block": (128, 128)}),
]
IDS = [f"{r}-{'-'.join(f'{k}={v}' for k, v in o.items())}" for r, o in CONFIGS]
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


def _same(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert y.dtype == ref.dtype and y.shape == ref.shape
    ny, nr = torch.isnan(y), torch.isnan(ref)
    assert torch.equal(ny, nr), f"NaN at {int((ny ^ nr).sum())} places differ"
    iv = {2: torch.int16, 4: torch.int32, 8: torch.int64}[y.element_size()]
    a, b = y[~ny].view(iv), ref[~nr].view(iv)
    if not torch.equal(a, b):
        i = int((a != b).nonzero()[0])
        raise AssertionError(f"{int((a != b).sum())} elements differ, first: {y[~ny][i]} vs {ref[~nr][i]}")


def _fast_ran(x, recipe, opts) -> bool:
    with torch.no_grad():
        return api._FAST[recipe](x, recipe, **opts) is not None


def _special(shape, g, dtype) -> torch.Tensor:
    """Random magnitudes over many binades, with planted specials and degenerate blocks."""
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-30, 30, shape, generator=g).double())
    f = x.view(-1)
    f[:32] = 0.0                                           # zero blocks (16 and 32 wide)
    f[32:64] = -0.0
    f[64:96] = 1e-30                                       # tiny blocks
    f[128:160] = torch.tensor([0.0, -0.0, 0.25, -0.75, 1.25, 1.75, -2.5, 3.5, 5.0, 6.0, -6.0, 448.0, 480.0, 464.0,
                               2.0 ** -9, 2.0 ** -10, -(2.0 ** -7), 1.5 * 2.0 ** -9, 57344.0, 61440.0, 1e-40, -1e-45,
                               7.5, -8.0, 7.25, 0.5, 1.0, 2.0, 3.0, 4.0, 6.5, -5.5])
    k = f.numel()
    idx = torch.randint(160, k, (40,), generator=g)
    f[idx[:10]] = 0.0
    f[idx[10:20]] = -0.0
    f[idx[20:30]] = torch.finfo(dtype).tiny / 4 if dtype != torch.bfloat16 else 1e-39
    big = torch.finfo(dtype).max
    return x.clamp(-big, big).to(dtype)                   # finite in every dtype (fp16: 65504)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", range(len(CONFIGS)), ids=IDS)
def test_fused_equals_reference(case, dtype):
    recipe, opts = CONFIGS[case]
    g = torch.Generator().manual_seed(case)
    for x in (torch.randn(256, 256, generator=g).to(dtype), _special((256, 256), g, dtype)):
        assert _fast_ran(x, recipe, opts)
        _same(api.fake_quant(x, recipe, **opts), api._fake_quant_reference(x, recipe, **opts))


@pytest.mark.parametrize("case", range(len(CONFIGS)), ids=IDS)
def test_fused_non_finite_inputs(case):
    """inf and NaN inside blocks (not for int4, whose reference refuses NaN: there the fused
    path hands over to the reference, which raises naming the index)."""
    recipe, opts = CONFIGS[case]
    g = torch.Generator().manual_seed(100 + case)
    x = _special((128, 256), g, torch.float32)
    x[3, 5], x[7, 100], x[64, 17] = float("inf"), -float("inf"), float("nan")
    if recipe.startswith("int4"):
        with pytest.raises(Exception):
            api._fake_quant_reference(x, recipe, **opts)
        with pytest.raises(Exception):
            api.fake_quant(x, recipe, **opts)
        return
    _same(api.fake_quant(x, recipe, **opts), api._fake_quant_reference(x, recipe, **opts))


@pytest.mark.parametrize("chunk", [16 * 128, 16 * 128 * 3, 1 << 13])
@pytest.mark.parametrize("case", [0, 2, 4, 6, 10, 14, 18, 22, 25], ids=[IDS[i] for i in (0, 2, 4, 6, 10, 14, 18, 22, 25)])
def test_fused_chunk_boundaries(case, chunk, monkeypatch):
    """Chunks of a few block-rows (and a remainder): per-tensor scales span chunks."""
    recipe, opts = CONFIGS[case]
    monkeypatch.setattr(blocks, "FUSED_CHUNK", chunk)
    g = torch.Generator().manual_seed(7)
    x = _special((272, 128), g, torch.bfloat16)              # 272 = 17 tiles of 16, 2 of 128 + rest
    if "block" in opts and opts["block"][0] == 128 or opts.get("tile") == (16, 16):
        x = x[:256]
    _same(api.fake_quant(x, recipe, **opts), api._fake_quant_reference(x, recipe, **opts))


def test_shapes_the_fused_path_leaves_to_the_reference():
    x = torch.randn(3, 40).to(torch.bfloat16)                 # 40 is no multiple of 16 / 32 / 128
    for recipe, opts in CONFIGS:
        if recipe in ("fp8_tensor", "fp8_token", "int4_g32", "int4_g32_kimi") or opts.get("block") in ((-1, -1),):
            continue
        if recipe in ("fp8_channel",) and "block" not in opts:
            continue
        assert not _fast_ran(x, recipe, opts), (recipe, opts)
        _same(api.fake_quant(x, recipe, **opts), api._fake_quant_reference(x, recipe, **opts))
    s = api.quantize(torch.randn(4, 64), "fp8_block").scales     # static scales: the reference
    assert api._FAST["fp8_block"](torch.randn(4, 128), "fp8_block", scale=s) is None
    y = torch.randn(2, 3, 64).to(torch.bfloat16)               # 3-D input: rows of the [R, C] view
    for recipe, opts in CONFIGS:
        if opts.get("tile") == (16, 16) or (opts.get("block") or (1,))[0] == 128:
            continue
        _same(api.fake_quant(y, recipe, **opts), api._fake_quant_reference(y, recipe, **opts))


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2", "e2m1"])
def test_round_grid_every_midpoint_and_neighbour(fmt):
    F = C.FORMATS[fmt]
    vals = C._tables(F, "cpu")[1].double()
    mids = ((vals[1:] + vals[:-1]) / 2).float()
    y = torch.cat([vals.float(), mids, torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(1e9)),
                   torch.rand(100_000, generator=torch.Generator().manual_seed(1)) * F.max_finite,
                   torch.tensor([0.0, 1e-45, 1e-40, 2.0 ** -126, 2.0 ** -127])])
    y = torch.cat([y, -y, torch.tensor([float("nan")])]).clamp(-F.max_finite, F.max_finite)
    ref = C.round_to(y, F)
    _same(C.round_grid(y, F), ref)
    _same(C.round_grid(y, F, keep_sign=False), torch.where(ref == 0, torch.zeros_like(ref), ref))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, len(CONFIGS) - 1), st.integers(0, 2 ** 31 - 1), st.floats(-30, 30),
       st.sampled_from(DTYPES[:3]))
def test_fused_equals_reference_property(case, seed, log_scale, dtype):
    recipe, opts = CONFIGS[case]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 256, generator=g) * torch.exp(torch.randn(32, 1, generator=g)) * 2.0 ** log_scale
    x[0, :8] = torch.tensor([0.0, -0.0, 1.0, -1.0, 0.5, 6.0, -6.0, 448.0]) * 2.0 ** round(log_scale)
    x = x.to(dtype)
    _same(api.fake_quant(x, recipe, **opts), api._fake_quant_reference(x, recipe, **opts))
