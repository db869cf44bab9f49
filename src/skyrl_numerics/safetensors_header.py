"""The header of a safetensors file, read and checked without loading any tensor: what the doctor,
the invariant model's loader and the trainers' workers read to learn a checkpoint's tensors."""
from __future__ import annotations

import json
from pathlib import Path

from skyrl_numerics.errors import InputError

# safetensors dtype names -> bytes per element
ST_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "F4": 1,
              "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
              "I64": 8, "U64": 8, "F64": 8}

def read_header(f: Path, src: str) -> dict:
    """The tensor entries of a safetensors file's header, checked against the file: a JSON
    object of ``{"dtype", "shape", "data_offsets"}`` entries whose byte ranges match their
    shapes and lie inside the data (a truncated file is refused, naming the tensor)."""
    def bad(msg):
        return InputError(f"{f.name} is not a readable safetensors file ({msg})", source=src,
                          field="weights")
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if not 0 < n < 1 << 30:
                raise bad(f"header length {n}")
            header = json.loads(fh.read(n))
    except OSError as e:
        raise bad(e) from None
    except (UnicodeDecodeError, ValueError) as e:
        raise bad(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise bad(f"header is a JSON {type(header).__name__}, not an object")
    data = size - 8 - n
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        if not (isinstance(e, dict) and e.get("dtype") in ST_DTYPES
                and isinstance(e.get("shape"), list) and isinstance(e.get("data_offsets"), list)
                and len(e["data_offsets"]) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                        for x in e["shape"] + e["data_offsets"])):
            raise bad(f"tensor {name!r}: entry {str(e)[:120]} is not a dtype, shape and data_offsets")
        lo, hi = e["data_offsets"]
        numel = 1
        for d in e["shape"]:
            numel *= d
        want = -(-numel // 2) if e["dtype"] == "F4" else numel * ST_DTYPES[e["dtype"]]
        if hi < lo or hi - lo != want:
            raise bad(f"tensor {name!r}: data_offsets {e['data_offsets']} hold {hi - lo} bytes, its "
                      f"{e['dtype']} shape {e['shape']} needs {want}")
        if hi > data:
            raise bad(f"tensor {name!r} ends at byte {hi} of a {data}-byte data section "
                      "(the file is truncated)")
        out[name] = e
    return out
