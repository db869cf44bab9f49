"""skyrl_numerics.quant: bit-exact low-precision numerics.

- element codecs (``codecs``): E4M3fn, E5M2, E2M1, E8M0, INT4, FP4 packing
- recipes: ``quantize(x, recipe, **opts) -> QTensor``, ``dequantize(q)``, ``fake_quant(x, recipe)``
  for the names in ``RECIPES`` (formulas in docs/quant.md and each recipe's docstring)
- FP8 KV cache: ``kv_fp8_codec`` (the bytes vLLM's cache kernels write and read back),
  ``kv_fp8_hf_cache`` (``FP8KVCache``, a transformers cache holding those values)
"""
from .api import RECIPES, dequantize, fake_quant, quantize, recipe_options, requantize
from .qtensor import QTensor

__all__ = ["RECIPES", "QTensor", "quantize", "dequantize", "fake_quant", "requantize", "recipe_options"]
from .qat import QATRule, apply_qat, remove_qat
from .ste import representable_range, ste_fake_quant

__all__ += ["QATRule", "apply_qat", "remove_qat", "ste_fake_quant", "representable_range"]
from .checkpoint import QATCheckReport, qat_check, write_quantized_checkpoint
from .kv_fp8_codec import (ds_mla_cache_read, ds_mla_cache_write, fp8_kv_read, fp8_kv_roundtrip, fp8_kv_write,
                 mla_cache_read, mla_cache_write)

__all__ += ["QATCheckReport", "qat_check", "write_quantized_checkpoint", "fp8_kv_write", "fp8_kv_read",
            "fp8_kv_roundtrip", "mla_cache_write", "mla_cache_read", "ds_mla_cache_write", "ds_mla_cache_read"]
from .qweights import load_quantized_weights

__all__ += ["load_quantized_weights"]
from .vendor_check import QATBaseReport, detect_scheme, qat_check_base

__all__ += ["QATBaseReport", "detect_scheme", "qat_check_base"]
