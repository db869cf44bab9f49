"""skyrl_numerics.replay: R3 routes (packing + router replay) and top-p/top-k support replay.

- :class:`PackedGates` — the engine's MoE combine weights beside the routes (fp16 by default).
- :class:`PackedIndex` — the DSA indexer's chosen key positions, bit-packed (the attention's routes);
  :func:`index_modes` / :class:`IndexReplay` replay them in the trainer's DSA forward (torch).
- :class:`PackedRoutes`, :class:`RouteTrace` — compact, zero-copy routes for ragged batches and multi-turn
  trajectories (numpy only).
- :func:`route_replay`, :func:`record_routes` — force / record the experts of HF MoE blocks (torch).
- :func:`megatron_route_replay`, :func:`megatron_record_routes` — the same through megatron-core's RouterReplay.
- :class:`PackedSupport`, :func:`support_logprobs` — sampled support sets and logprobs renormalized over them.

Torch-dependent names load lazily so ``import skyrl_numerics.replay`` needs only numpy.
"""

from .bitpack import bits_for, pack_bits, unpack_bits
from .gates import PackedGates
from .index import PackedIndex
from .routes import PackedRoutes, id_dtype
from .support import PackedSupport
from .trace import RouteTrace
from .vllm_wire import decode_vllm_routes, encode_vllm_routes

_LAZY = {
    "route_replay": ".hf_replay",
    "record_routes": ".hf_replay",
    "RouteRecorder": ".hf_replay",
    "padded_token_index": ".hf_replay",
    "packed_token_index": ".hf_replay",
    "megatron_route_replay": ".megatron",
    "megatron_record_routes": ".megatron",
    "megatron_replay_indices": ".megatron",
    "support_logprobs": ".support_lp",
    "IndexReplay": ".index_replay",
    "IndexRecorder": ".index_replay",
    "index_modes": ".index_replay",
    "support_logprobs_reference": ".support_lp",
}

__all__ = ["PackedRoutes", "PackedGates", "PackedIndex", "PackedSupport", "RouteTrace", "id_dtype", "decode_vllm_routes", "encode_vllm_routes",
           "bits_for", "pack_bits", "unpack_bits", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
