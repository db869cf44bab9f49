"""The one place that patches vLLM's server side (vLLM 0.32) — every patch listed, reversible.

Installed by our ``vllm.general_plugins`` entry point (:func:`install` in ``vllm_plugin.register``)
in every vLLM process; :func:`uninstall` puts every original object back (reference-counted;
tested in ``tests/trainer/test_vllm_patches.py``). Worker-side hooks that act on a running model
(route and support capture) live in ``vllm_ext.py`` and are installed per engine on request;
this module holds the patches of vLLM's own classes and module globals.

``vllm.entrypoints.serve.middleware.authenticate.GUARDED_PREFIX``
    vLLM's ``--api-key`` middleware checks only paths under ``/v1``, ``/v2``, ``/inference`` and
    ``/cohere``: with ``VLLM_SERVER_DEV_MODE=1`` anyone who reaches the port can call
    ``/init_weight_transfer_engine``, ``/update_weights``, ``/collective_rpc``, ``/pause``, ...
    and replace or break the served model (seen here: an unauthenticated ``/start_weight_update``
    of the nccl backend left the weights on the meta device). While installed, every control
    route (:data:`CONTROL_ROUTES`) needs the key too; ``/health``, ``/ping``, ``/version``,
    ``/metrics`` and ``/load`` stay open for probes. Without ``--api-key`` nothing is checked,
    as before (``skyrl-numerics serve`` refuses a non-loopback address without one).
``vllm.v1.engine.async_llm.AsyncLLM.finish_weight_update``
    vLLM does not reset the prefix cache after a weight update, so a later request sharing a
    prefix would attend to KV computed with the old weights. The wrapper runs the original and
    then ``reset_prefix_cache()``; when requests are still running (``/pause?mode=keep``) it
    resets with ``reset_running_requests=True``: those requests are recomputed from their tokens
    on the new weights, so no token sampled after an update attends to old-weight KV.
"""
from __future__ import annotations

import contextlib
import functools
import threading

__all__ = ["install", "uninstall", "installed", "patched", "CONTROL_ROUTES", "OPEN_ROUTES"]

OPEN_ROUTES = ("/health", "/ping", "/version", "/metrics", "/load")
CONTROL_ROUTES = (
    "/abort_requests", "/collective_rpc", "/fault_tolerance", "/finish_weight_update",
    "/get_world_size", "/init_weight_transfer_engine", "/is_paused", "/is_scaling_elastic_ep",
    "/is_sleeping", "/kv_event_sources", "/pause", "/release_kv_cache_memory", "/reset_",
    "/resume", "/scale_elastic_ep", "/server_info", "/shutdown_weight_transfer_engine", "/sleep",
    "/start_", "/stop_profile", "/tokenize", "/detokenize", "/tokenizer_info", "/update_",
    "/wake_up", "/weight_", "/classify", "/score", "/rerank", "/pooling", "/invocations",
    "/generative_scoring", "/openapi.json", "/docs", "/redoc",
)

_lock = threading.RLock()
_depth = 0
_saved: list[tuple[object, str, object]] = []   # (owner, attribute, original)


def _set(owner, name: str, value) -> None:
    _saved.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def _guard_control_routes() -> None:
    from vllm.entrypoints.serve.middleware import authenticate

    _set(authenticate, "GUARDED_PREFIX", tuple(authenticate.GUARDED_PREFIX) + CONTROL_ROUTES)


def _reset_prefix_cache_after_update() -> None:
    from vllm.v1.engine.async_llm import AsyncLLM

    original = AsyncLLM.finish_weight_update

    @functools.wraps(original)
    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await original(self, weight_version)
        if not await self.reset_prefix_cache():
            await self.reset_prefix_cache(reset_running_requests=True)

    finish_weight_update.skyrl_original = original
    _set(AsyncLLM, "finish_weight_update", finish_weight_update)


_PATCHES = (_guard_control_routes, _reset_prefix_cache_after_update)


def install() -> None:
    """Apply every patch (reference-counted: nested installs need as many uninstalls)."""
    global _depth
    with _lock:
        if _depth == 0:
            try:
                for patch in _PATCHES:
                    patch()
            except BaseException:
                _restore()
                raise
        _depth += 1


def _restore() -> None:
    while _saved:
        owner, name, original = _saved.pop()
        setattr(owner, name, original)


def uninstall() -> None:
    """Undo one :func:`install`; the last one puts every original object back."""
    global _depth
    with _lock:
        if _depth == 0:
            return
        _depth -= 1
        if _depth == 0:
            _restore()


def installed() -> bool:
    return _depth > 0


@contextlib.contextmanager
def patched():
    """``with patched(): ...`` — the patches for the duration of the block."""
    install()
    try:
        yield
    finally:
        uninstall()
