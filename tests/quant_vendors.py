"""Load the vendors' own reference functions for the convention tests.

* torchao: imported normally (``torchao.prototype.mx_formats``; the CUDA extensions fail to load on
  CPU with a warning, the torch paths run).
* nvidia-modelopt: its package ``__init__`` pulls in omegaconf, pydantic, FSDP helpers, ... which
  ``pip install --no-deps`` does not bring. We load only the quantization files we need
  (``qtensor/nvfp4_tensor.py``, ``mxfp8_tensor.py``, ``base_qtensor.py``, ``utils/numeric_utils.py``,
  ``backends/utils.py``) under their real module names, with the parent packages replaced by empty
  stubs, and take the three reduction helpers they use (``reduce_amax``, ``reduce_block_amax``,
  ``reduce_block_padding``) out of ``utils/core_utils.py`` by source (``ast``), unchanged. The
  vendor's code runs as written; only its import graph is cut.
"""
from __future__ import annotations

import ast
import importlib.util
import sys
import types
from pathlib import Path

import pytest

_MODELOPT = None


def modelopt_qtensors():
    """-> namespace with ``NVFP4QTensor``, ``MXFP8QTensor``, ``FP8QTensor``, ``cast_per_block_scale_to_fp8``,
    ``version``. Skips the test when nvidia-modelopt is not installed."""
    global _MODELOPT
    if _MODELOPT is not None:
        return _MODELOPT
    spec = importlib.util.find_spec("modelopt")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("nvidia-modelopt is not installed (make venv installs it with --no-deps)")
    root = Path(list(spec.submodule_search_locations)[0])
    q = root / "torch" / "quantization"
    import torch
    import torch.nn.functional as F

    saved = {k: v for k, v in sys.modules.items() if k == "modelopt" or k.startswith("modelopt.")}
    for k in saved:
        del sys.modules[k]

    def pkg(name, path):
        m = types.ModuleType(name)
        m.__path__ = [str(path)]
        sys.modules[name] = m
        return m

    def load(name, path):
        s = importlib.util.spec_from_file_location(name, path)
        m = importlib.util.module_from_spec(s)
        sys.modules[name] = m
        s.loader.exec_module(m)
        return m

    try:
        pkg("modelopt", root)
        pkg("modelopt.torch", root / "torch")
        pkg("modelopt.torch.quantization", q)
        pkg("modelopt.torch.quantization.backends", q / "backends")
        pkg("modelopt.torch.quantization.qtensor", q / "qtensor")
        utils = pkg("modelopt.torch.quantization.utils", q / "utils")
        # the reduction helpers, verbatim from core_utils.py (its imports are the heavy part)
        src = (q / "utils" / "core_utils.py").read_text()
        want = {"reduce_amax", "reduce_block_amax", "reduce_block_padding", "_FP8_DTYPES",
                "convert_quantization_axis_to_reduce_axis"}
        nodes = [n for n in ast.parse(src).body
                 if (isinstance(n, ast.FunctionDef) and n.name in want)
                 or (isinstance(n, ast.Assign) and any(getattr(t, "id", None) in want for t in n.targets))]
        utils.__dict__.update({"torch": torch, "F": F})
        exec(compile(ast.Module(body=nodes, type_ignores=[]), str(q / "utils" / "core_utils.py"), "exec"),
             utils.__dict__)
        utils.fsdp2_aware_weight_update = None          # named by base_qtensor's import, unused here
        utils.patch_fsdp_mp_dtypes = None
        load("modelopt.torch.quantization.utils.numeric_utils", q / "utils" / "numeric_utils.py")
        load("modelopt.torch.quantization.backends.utils", q / "backends" / "utils.py")
        load("modelopt.torch.quantization.qtensor.base_qtensor", q / "qtensor" / "base_qtensor.py")
        nv = load("modelopt.torch.quantization.qtensor.nvfp4_tensor", q / "qtensor" / "nvfp4_tensor.py")
        mx8 = load("modelopt.torch.quantization.qtensor.mxfp8_tensor", q / "qtensor" / "mxfp8_tensor.py")
        fp8 = load("modelopt.torch.quantization.qtensor.fp8_tensor", q / "qtensor" / "fp8_tensor.py")
    finally:
        for k in [k for k in sys.modules if k == "modelopt" or k.startswith("modelopt.")]:
            del sys.modules[k]
        sys.modules.update(saved)
    from importlib.metadata import version
    _MODELOPT = types.SimpleNamespace(NVFP4QTensor=nv.NVFP4QTensor, MXFP8QTensor=mx8.MXFP8QTensor,
                                      FP8QTensor=fp8.FP8QTensor,
                                      cast_per_block_scale_to_fp8=nv._cast_per_block_scale_to_fp8,
                                      version=version("nvidia-modelopt"))
    return _MODELOPT


def torchao_mx():
    """-> namespace with torchao's ``nvfp4_quantize``, ``NVFP4Tensor``, ``per_tensor_amax_to_scale``,
    ``to_mx``, ``to_dtype``, ``ScaleCalculationMode``, ``version``; skips without torchao."""
    pytest.importorskip("torchao")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
        from torchao.prototype.mx_formats.nvfp4_tensor import (NVFP4Tensor, nvfp4_quantize,
                                                               per_tensor_amax_to_scale)
    from importlib.metadata import version
    return types.SimpleNamespace(nvfp4_quantize=nvfp4_quantize, NVFP4Tensor=NVFP4Tensor,
                                 per_tensor_amax_to_scale=per_tensor_amax_to_scale, to_mx=to_mx,
                                 to_dtype=to_dtype, ScaleCalculationMode=ScaleCalculationMode,
                                 version=version("torchao"))
