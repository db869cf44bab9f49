"""Triton fake-quant kernels bitwise against the torch recipes + sm_90/sm_100 compile.

The kernel tests run per ``device`` (tests/device_cases.py, one case list ``QUANT_CASES``):
``cpu`` is marked ``interpreter`` and runs in a child pytest with ``TRITON_INTERPRET=1`` in the
child's environment only (tests/triton_child.py); ``cuda`` is marked ``gpu`` (compiled kernels,
skipped without a CUDA device), as is the large-tensor test. The compile test needs the
interpreter off."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from skyrl_numerics.quant import fake_quant, quantize
from skyrl_numerics.quant.ste import representable_range

from device_cases import CUDA_ONLY, DEVICES, QUANT_CASES, QUANT_IDS, QUANT_TINY_CONVENTIONS, SIZES, resolve

pytestmark = [pytest.mark.triton, pytest.mark.filterwarnings("ignore::RuntimeWarning")]
interpreter = pytest.mark.interpreter

CASES, IDS = QUANT_CASES, QUANT_IDS


def _data(seed, dtype):
    g, cpu = torch.Generator().manual_seed(seed), "cpu"      # the same values on every device
    x = torch.randn(24, 256, generator=g, device=cpu) * torch.exp(torch.randn(24, 1, generator=g, device=cpu) * 3)
    x[0, :128] = 0                                             # all-zero blocks
    x[1, :16] = torch.tensor([6.375, 5.0, 0.25, -0.75, 2.5, -3.5, 1e-30, -0.0] * 2, device=cpu)   # ties, tiny, -0
    x[2, :32] = 2.0 ** torch.arange(-16, 16, device=cpu).float()   # a wide block
    x[3] *= 1e-38                                              # fp32-subnormal-ish block amax
    return x.to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_bitwise_equals_reference(case, dtype, device):
    from skyrl_numerics.quant.triton_fq import fake_quant_triton
    recipe, opts = CASES[case]
    for seed in range(2):
        x = _data(seed, dtype).to(resolve(device))
        if "global_amax" in opts:
            x = x.clamp(-3, 3)
        ref = fake_quant(x, recipe, **opts)
        out, mask = fake_quant_triton(x, recipe, clip_mask=True, **opts)
        assert out.dtype == x.dtype
        assert torch.equal(out.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           ref.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
        lo, hi = representable_range(quantize(x, recipe, **opts))
        assert torch.equal(mask.bool(), (x.float() >= lo) & (x.float() <= hi))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("conv", QUANT_TINY_CONVENTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_tiny_tensors_equal_reference(conv, dtype, device):
    """Subnormal and tiny tensors: the global is so small that element multipliers overflow to inf
    and exact zeros meet ``0 * inf`` (the reference encodes them as 0), MX scale code 0 blocks."""
    from skyrl_numerics.quant.triton_fq import fake_quant_triton
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=g, device="cpu").to(resolve(device))
    x[:, ::5] = 0
    x[0, 1::5] = -0.0
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for scale in (2.0 ** -100, 2.0 ** -120, 1e-38, 1e-40, 1e-42):
        xs = (x * scale).to(dtype)
        cases = [("nvfp4", {"convention": conv})] + ([("mxfp8", {}), ("mxfp8", {"elem": "e5m2"}), ("mxfp4", {}),
                                                       ("mxfp8", {"scale_mode": "rceil"})] if conv == "vllm" else [])
        for recipe, opts in cases:
            assert torch.equal(fake_quant_triton(xs, recipe, **opts).view(bits),
                               fake_quant(xs, recipe, **opts).view(bits)), (recipe, opts, scale)


@interpreter
def test_kernel_refuses_options_it_does_not_implement():
    from skyrl_numerics.errors import InputError
    from skyrl_numerics.quant.triton_fq import fake_quant_triton
    with pytest.raises(InputError, match="global_scale"):
        fake_quant_triton(torch.ones(2, 16), "nvfp4", convention="torchao", global_scale=1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_ste_gradients(device):
    from skyrl_numerics.quant.triton_fq import ste_fake_quant_triton
    x = torch.randn(4, 64) * 4
    x[0, 0] = 7.9                                              # mxfp4 floor: saturates -> no gradient (clipped)
    x[0, 1:32] = 0.01
    x.requires_grad_(True)
    ste_fake_quant_triton(x, "mxfp4", clip=True).sum().backward()
    lo, hi = representable_range(quantize(x.detach(), "mxfp4"))
    assert torch.equal(x.grad, ((x.detach() >= lo) & (x.detach() <= hi)).float())
    assert x.grad[0, 0].item() == 0.0
    x.grad = None
    ste_fake_quant_triton(x, "nvfp4", convention="te").sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


@pytest.mark.parametrize("device", CUDA_ONLY)
@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_kernel_bitwise_equals_reference_on_a_large_tensor(case, device):
    """A large bf16 tensor (64M elements on the GPU; the dry run's 4096): every block of it."""
    from skyrl_numerics.quant.triton_fq import fake_quant_triton
    recipe, opts = CASES[case]
    n = SIZES["quant_n"] - SIZES["quant_n"] % 4096
    g = torch.Generator(device=resolve(device)).manual_seed(0)
    x = (torch.randn(n // 4096, 4096, generator=g, device=resolve(device)) *
         torch.exp(torch.randn(n // 4096, 1, generator=g, device=resolve(device)))).to(torch.bfloat16)
    if "global_amax" in opts:
        x = x.clamp(-3, 3)
    out, ref = fake_quant_triton(x, recipe, **opts), fake_quant(x, recipe, **opts)
    bad = int((out.view(torch.int16) != ref.view(torch.int16)).sum())
    assert bad == 0, f"{bad} of {n:,} elements differ from the torch recipe"


COMPILE = textwrap.dedent("""
    import triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from skyrl_numerics.quant import triton_fq as K
    specs = [
        (K._fp8_block_kernel, {"x_ptr": "*i16", "out_ptr": "*i16", "mask_ptr": "*i8", "nblk": "i32",
                               "eps": "fp32", "rcp448": "fp32", "BLK": "constexpr", "BPP": "constexpr",
                               "UE8M0": "constexpr", "WRITE_MASK": "constexpr"},
         {"BLK": 128, "BPP": 16, "UE8M0": True, "WRITE_MASK": True}),
        (K._mx_kernel, {"x_ptr": "*i16", "out_ptr": "*i16", "mask_ptr": "*i8", "nblk": "i32",
                        "BLK": "constexpr", "BPP": "constexpr", "MBITS": "constexpr", "EMIN": "constexpr",
                        "MAXV": "constexpr", "EMAX": "constexpr", "RCEIL": "constexpr", "WRITE_MASK": "constexpr"},
         {"BLK": 32, "BPP": 16, "MBITS": 3, "EMIN": -6, "MAXV": 448.0, "EMAX": 8, "RCEIL": True, "WRITE_MASK": False}),
    ] + [
        (K._nvfp4_kernel, {"x_ptr": "*i16", "out_ptr": "*i16", "mask_ptr": "*i8", "glob_ptr": "*fp32",
                           "nblk": "i32", "BPP": "constexpr", "CONV": "constexpr", "WRITE_MASK": "constexpr"},
         {"BPP": 16, "CONV": conv, "WRITE_MASK": True}) for conv in range(5)
    ]
    for arch in (90, 100):
        for fn, sig, cx in specs:
            k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx), target=GPUTarget("cuda", arch, 32),
                               options={"enable_fp_fusion": False})   # as fake_quant_triton launches them
            ptx = k.asm["ptx"]
            assert f".target sm_{arch}" in ptx, (arch, fn)
            assert "div.full" not in ptx and "div.approx" not in ptx, "approximate division in the kernel"
            assert "fma." not in ptx and ".ftz" not in ptx, "contracted FMA or flush-to-zero in the kernel"
            assert len(k.asm["cubin"]) > 0
            print("ok", arch, fn.__name__)
""")


@pytest.mark.slow
def test_kernels_compile_for_sm90_and_sm100():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("ok") == 14
