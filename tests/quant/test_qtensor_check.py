"""``dequantize`` checks a QTensor against its recipe's layout before decoding: whatever
``quantize`` makes passes, for every recipe and shape; a QTensor with any one field tampered
with (codes cut, reshaped or retyped, scales cut, flattened or retyped, the shape, the block or
the recipe changed, a global scale removed or added, a negative scale) is the project's error
naming the field — before, several of these decoded silently into other numbers."""
import dataclasses

import pytest
import torch
from hypothesis import given, settings, strategies as st

from skyrl_numerics.errors import InputError
from skyrl_numerics.quant import dequantize, quantize
from skyrl_numerics.quant.api import _Q, check_qtensor

RECIPES = sorted(_Q)


def _q(recipe, shape, seed):
    g = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(*shape, generator=g).to(torch.bfloat16), recipe)


@settings(max_examples=60, deadline=None)
@given(recipe=st.sampled_from(RECIPES), lead=st.lists(st.integers(1, 9), min_size=0, max_size=2),
       C=st.sampled_from([16, 32, 48, 64, 96, 160, 256]), seed=st.integers(0, 999))
def test_what_quantize_makes_passes_and_decodes(recipe, lead, C, seed):
    q = _q(recipe, (*lead, C) if lead else (3, C), seed)
    check_qtensor(q)
    assert dequantize(q).shape == q.shape


def _tamperings(q):
    C = q.shape[-1]
    yield "codes cut", dataclasses.replace(q, codes=q.codes[..., :-1])
    yield "codes retyped", dataclasses.replace(q, codes=q.codes.view(torch.uint8).to(torch.float32))
    yield "codes flattened", dataclasses.replace(q, codes=q.codes.reshape(-1))
    yield "scales cut", dataclasses.replace(q, scales=q.scales[:-1])
    yield "scales flattened", dataclasses.replace(q, scales=q.scales.reshape(-1))
    yield "scales retyped", dataclasses.replace(q, scales=q.scales.view(torch.uint8) if q.scales.element_size() == 1
                                                else q.scales.to(torch.int32))
    yield "shape changed", dataclasses.replace(q, shape=(q.shape[0] * 2, C // 2))
    yield "shape not sizes", dataclasses.replace(q, shape=(3.0, C))
    yield "block changed", dataclasses.replace(q, block=(1, 1))      # (a block wider than C is no change)
    yield "block not sizes", dataclasses.replace(q, block=(0, q.block[1]))
    yield "dtype not float", dataclasses.replace(q, dtype=torch.int32)
    if q.global_scale is None:
        yield "global scale added", dataclasses.replace(q, global_scale=torch.tensor(1.0))
    else:
        yield "global scale removed", dataclasses.replace(q, global_scale=None)
        yield "global scale retyped", dataclasses.replace(q, global_scale=q.global_scale.double())
    if q.scales.dtype.is_floating_point and q.scales.element_size() > 1:
        neg = q.scales.clone()
        neg.view(-1)[0] = -1.0
        yield "a negative scale", dataclasses.replace(q, scales=neg)


@pytest.mark.parametrize("recipe", RECIPES)
def test_any_single_tampered_field_is_refused(recipe):
    q = _q(recipe, (6, 64), 0)
    cases = list(_tamperings(q))
    assert len(cases) >= 12
    for what, bad in cases:
        with pytest.raises(InputError) as e:
            dequantize(bad)
            pytest.fail(f"{recipe}: {what} was decoded")
        assert "\n" not in str(e.value) and e.value.field, (what, str(e.value))


@pytest.mark.parametrize("src,dst", [("int4_g32", "fp8_tensor"), ("mxfp8", "int4_g32"),
                                     ("mxfp4", "nvfp4"), ("nvfp4", "mxfp4"), ("fp8_block", "mxfp8")])
def test_a_swapped_recipe_is_refused(src, dst):
    q = _q(src, (6, 64), 1)
    with pytest.raises(InputError):
        dequantize(dataclasses.replace(q, recipe=dst))


def test_dequantize_to_a_non_float_dtype_is_refused():
    q = _q("fp8_tensor", (4, 32), 2)
    with pytest.raises(InputError, match="dtype"):
        dequantize(q, torch.int32)
    assert dequantize(q, torch.float32).dtype == torch.float32


@pytest.mark.parametrize("recipe,opts,field", [
    ("fp8_tensor", {"scale": "x"}, "scale"),
    ("nvfp4", {"global_amax": "x"}, "global_amax"),
    ("fp8_token", {"scale_ub": "x"}, "scale_ub"),
    ("fp8_token", {"scale_ub": -1.0}, "scale_ub"),          # used to saturate every code
    ("fp8_block", {"eps": -1.0}, "eps"),
    ("fp8_block", {"eps": float("nan")}, "eps"),            # used to give an all-NaN output
    ("fp8_block", {"block": "x"}, "block"),
    ("fp8_block", {"block": (1.5, 128)}, "block"),
    ("fp8_block", {"ue8m0": "yes"}, "ue8m0"),
    ("int4_g32", {"group": 2.5}, "group"),
    ("int4_g32", {"group": "32"}, "group"),
    ("int4_g32", {"scale_dtype": torch.int8}, "scale_dtype"),
    ("fp8_channel", {"scale_dtype": "float32"}, "scale_dtype"),
    ("nvfp4", {"tile": (1, 16.0)}, "tile"),
])
@pytest.mark.parametrize("api", ["quantize", "fake_quant"])
def test_options_of_the_wrong_type_are_refused_naming_them(recipe, opts, field, api):
    from skyrl_numerics.quant import fake_quant

    x = torch.randn(8, 128).to(torch.bfloat16)
    fn = quantize if api == "quantize" else fake_quant
    with pytest.raises(InputError) as e:
        fn(x, recipe, **opts)
    assert e.value.field == field, str(e.value)


@pytest.mark.parametrize("recipe", RECIPES)
def test_scalars_and_unhashable_recipe_names_are_refused(recipe):
    from skyrl_numerics.quant import fake_quant

    with pytest.raises(InputError):
        fake_quant(torch.tensor(1.0), recipe)
    with pytest.raises(InputError):
        fake_quant(torch.randn(4, 32), [recipe])
