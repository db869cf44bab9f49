"""``QTensor``: what a serving format stores for one quantized tensor."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class QTensor:
    """Codes + scales of one tensor in a named recipe.

    codes:  element codes in the input's shape. FP8 as ``torch.float8_e4m3fn`` / ``float8_e5m2``;
            FP4 (E2M1) packed two per byte, low nibble first, ``uint8 [..., C/2]``; INT4 as
            ``int8`` values in [-8, 7] (use :func:`codecs.pack_int4` for storage).
    scales: per-block scales, shape ``[R/br, C/bc]`` for the 2-D view ``[R, C]`` of the input,
            in the dtype the format stores: ``float32`` (fp8 recipes), ``float8_e8m0fnu`` (MX),
            ``float8_e4m3fn`` (NVFP4), ``bfloat16``/input dtype (int4).
    global_scale: NVFP4's per-tensor float32 scalar, in the convention's own meaning
            (see ``recipes_nvfp4``); None elsewhere.
    block:  the resolved block shape ``(br, bc)`` (``(R, C)`` for per-tensor).
    shape, dtype: the original tensor's shape and dtype (``dequantize`` returns this dtype).
    opts:   the options that decoding needs (convention, element format, ...).
    """

    recipe: str
    codes: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor | None
    block: tuple[int, int]
    shape: tuple[int, ...]
    dtype: torch.dtype
    opts: dict = field(default_factory=dict)
