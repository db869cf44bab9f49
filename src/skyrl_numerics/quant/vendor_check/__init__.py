"""The vendor-checkpoint checker (``skyrl-numerics qat-check QUANT_DIR --base BASE_DIR``): does the
trainer's fake-quant of the bf16 master weights give exactly the codes and scales a serving
checkpoint (modelopt, compressed-tensors, DeepSeek FP8, GPT-OSS MXFP4) holds?

- :mod:`.readers`: strict reading of the checkpoint — every config field and stored tensor
  validated, every quantized tensor accounted for (the project's errors name file, tensor, field);
- :mod:`.schemes`: what spans tensors — fused projections sharing an NVFP4 global, the globals a
  writer can store, compressed-tensors' target/ignore rules;
- :mod:`.check`: :func:`qat_check_base` (detect the scheme, match base tensors, recompute and
  compare bitwise) and its report.

Imports go one way: ``check`` -> ``schemes`` -> ``readers``.
"""
from .check import QATBaseReport, detect_scheme, qat_check_base

__all__ = ["QATBaseReport", "detect_scheme", "qat_check_base"]
