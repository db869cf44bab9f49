"""One place for the device parametrization and the case lists of the Triton-kernel, mode and
Triton fake-quant tests, shared by the CPU runs and the GPU runs (``pytest -m gpu``).

Devices: a test that takes ``device`` runs once per entry of ``DEVICES`` (Triton tests) or
``MODE_DEVICES`` (tests of ``batch_invariant_mode``, which run the CPU kernels on CPU):

  cpu   as before: ``DEVICES`` marks it ``interpreter`` (it runs in the child pytest with
        ``TRITON_INTERPRET=1``, tests/triton_child.py)
  cuda  marked ``gpu``; skipped with the reason "no CUDA device" when ``torch.cuda.is_available()``
        is False. Compiled Triton kernels on CUDA tensors.

``CUDA_ONLY`` is for checks that only make sense on a GPU (real-size shapes, the bf16 ``tl.dot``).
For a test with a ``device`` parameter, tests/conftest.py makes that device the default of
torch's factory functions (``torch.randn``, ``torch.tensor``, ``nn.Linear``) when it is not the
CPU, so one test body serves both devices.

Dry run (``benchmarks/gpu_check.py --dry-run``): the harness sets ``SKYRL_NUMERICS_GPU_DRY_RUN=1``
and ``TRITON_INTERPRET=1`` in its child pytest only; there the ``cuda`` cases run on CPU tensors
in the interpreter (``resolve("cuda") == "cpu"``) and ``SIZES`` are the tiny ``DRY_SIZES``.
"""
from __future__ import annotations

import os

import pytest
import torch

DRY_ENV = "SKYRL_NUMERICS_GPU_DRY_RUN"
DRY = os.environ.get(DRY_ENV) == "1"
HAS_CUDA = torch.cuda.is_available()

needs_cuda = pytest.mark.skipif(not (HAS_CUDA or DRY), reason="no CUDA device")
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda], id="cuda")
DEVICES = [pytest.param("cpu", marks=pytest.mark.interpreter, id="cpu"), CUDA]
MODE_DEVICES = [pytest.param("cpu", id="cpu"), CUDA]
CUDA_ONLY = [CUDA]


def resolve(device: str) -> str:
    """The torch device a ``device`` parameter runs on (the dry run's "cuda" is the CPU)."""
    return "cpu" if device == "cuda" and DRY else device


# ---------------------------------------------------------------------------- Triton kernels
# tile configs of the small-shape tests: several M/N/K tiles on tiny shapes. (BM, BN, BK, GROUP_M,
# warps, stages); tl.dot needs every tile dim >= 16 on the GPU.
SMALL = (16, 16, 16, 2, 4, 1)


def attention_tiles(device: str) -> dict:
    """Tiles of the small attention tests: the interpreter runs block_n=8 (several key blocks on
    tiny sequences); the GPU's tl.dot needs 16."""
    return dict(split=16, block_m=16, block_n=8 if resolve(device) == "cpu" else 16)


ATTENTION_DECODE = [(2, 2, 37), (4, 1, 20)]          # (H, Hkv, S), B=2, D=16

# real-size shapes (CUDA_ONLY tests); the dry run's are tiny
GPU_SIZES = dict(
    mm=[("bfloat16", 4096, 4096, 4096), ("float32", 1024, 1024, 1024), ("bfloat16", 1000, 4000, 3000)],
    mm_ms=(1, 3, 16, 127, 1000), bmm=(8, 512, 1024, 1024), grouped=(4096, 8, 2048, 1024),
    vocab=(64, 151936), rms=(1000, 4096), reduce=(64, 40000),
    attn=(2, 16, 4, 1500, 128), attn_ref=(1, 8, 2, 300, 128), attn_step=37,
    moe=dict(vocab=512, hidden=256, inter=128, layers=2, heads=4, kv_heads=2, head_dim=64,
             experts=8, topk=2, seq=16, dtype="bfloat16"),
    quant_n=64 * 2**20,
)
DRY_SIZES = dict(
    mm=[("bfloat16", 40, 48, 40), ("float32", 24, 40, 24), ("bfloat16", 21, 37, 19)],
    mm_ms=(1, 3, 16), bmm=(2, 9, 24, 20), grouped=(30, 3, 16, 24),
    vocab=(6, 300), rms=(9, 40), reduce=(5, 90),
    attn=(1, 2, 1, 40, 16), attn_ref=(1, 2, 1, 20, 16), attn_step=9,
    moe=dict(vocab=64, hidden=32, inter=32, layers=1, heads=2, kv_heads=1, head_dim=16,
             experts=4, topk=2, seq=6, dtype="float32"),
    quant_n=4096,
)
SIZES = DRY_SIZES if DRY else GPU_SIZES
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}   # max rel err vs float64

# ---------------------------------------------------------------------------- batch_invariant_mode
# the aten ops whose rows the mode claims invariant, probed on the device (test_mode.py)
MODE_OPS = ["mm", "addmm", "bmm", "_grouped_mm", "_log_softmax", "_log_softmax_backward_data",
            "_softmax", "_softmax_backward_data", "mean.dim"]
MODE_DTYPES = [torch.bfloat16, torch.float32]

# ---------------------------------------------------------------------------- Triton fake-quant
QUANT_CASES = [
    ("fp8_block", {}), ("fp8_block", {"ue8m0": True}),
    ("mxfp8", {}), ("mxfp8", {"scale_mode": "rceil"}), ("mxfp8", {"elem": "e5m2"}),
    ("mxfp8", {"elem": "e5m2", "scale_mode": "rceil"}), ("mxfp4", {}), ("mxfp4", {"scale_mode": "rceil"}),
    ("nvfp4", {"convention": "vllm"}), ("nvfp4", {"convention": "te"}),
    ("nvfp4", {"convention": "modelopt"}), ("nvfp4", {"convention": "torchao"}),
    ("nvfp4", {"convention": "compressed_tensors"}), ("nvfp4", {"convention": "te", "global_amax": 3.0}),
    ("nvfp4", {"convention": "torchao<0.17"}), ("nvfp4", {"convention": "modelopt<0.45"}),
    ("nvfp4", {"convention": "modelopt", "global_amax": 1e4}),
]
QUANT_IDS = [f"{r}-{'-'.join(f'{k}={v}' for k, v in o.items())}" for r, o in QUANT_CASES]
QUANT_TINY_CONVENTIONS = ["vllm", "te", "modelopt", "torchao", "compressed_tensors", "torchao<0.17"]
