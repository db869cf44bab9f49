"""The HTTP route SkyRL 0.4's delta weight sync calls that vLLM 0.32 lacks: ``POST /fetch_weights``,
served through a vLLM endpoint plugin (``vllm/plugins/endpoint_plugins/interface.py``: routes in the
API process, paired with a worker method — here the worker extension's ``skyrl_fetch_weights``).

``/fetch_weights`` takes SkyRL's body (``SkyrlWeightSyncClient.fetch_weights``;
``vllm_server_actor.py`` is SkyRL's own version of the route)::

    {"target_version": int >= 1, "sync_dir": str (optional), "uri": str (optional)}

and runs ``skyrl_fetch_weights`` on every worker: the ``skyrl_delta`` backend reads and verifies
SkyRL's store up to ``target_version`` (``engine/skyrl_delta_compat.py``) while the server keeps
generating; the weights change only at the following ``/update_weights``. Answers ``{"status":
"ok", "result": [per worker: {"target_version", "stats"}]}``; a malformed body is 400 naming the
field; a refused store (a gap, a bad manifest, a corrupt payload, a tensor the model lacks) is 400
with the worker's one-line reason. It changes what the next update loads, so it sits behind
``--api-key`` with the other control routes (``vllm_patches.CONTROL_ROUTES``).

Attached by the one endpoint plugin of ours, ``skyrl_route.SkyrlEndpoints`` (with SkyRL's
``/skyrl/v1/generate``), on servers started with our worker extension only.
"""
from __future__ import annotations

import json
import re

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse


router = APIRouter()
# vLLM's wrapping of a worker's exception (v1/executor): keep the worker's own one-line reason
_WORKER_ERROR = re.compile(r"Worker failed with error '(.*)', please check", re.S)


def _error(status: int, message: str, field: str | None = None) -> JSONResponse:
    err = {"message": " ".join(str(message).split()), "type": "BadRequestError", "code": status}
    if field is not None:
        err["param"] = field
    return JSONResponse(status_code=status, content={"error": err})


def fetch_kwargs(body) -> tuple[dict | None, JSONResponse | None]:
    """The worker call's kwargs from SkyRL's body, or the 400 answer naming the bad field."""
    if not isinstance(body, dict):
        return None, _error(400, "the body must be a JSON object")
    unknown = sorted(set(body) - {"target_version", "sync_dir", "uri"})
    if unknown:
        return None, _error(400, f"unknown field {unknown[0]!r}", unknown[0])
    v = body.get("target_version")
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        return None, _error(400, f"'target_version' must be an integer >= 1, got {v!r}", "target_version")
    kwargs = {"target_version": v}
    for k in ("sync_dir", "uri"):
        if body.get(k) is not None:
            if not (isinstance(body[k], str) and body[k]):
                return None, _error(400, f"{k!r} must be a non-empty string", k)
            kwargs[k] = body[k]
    return kwargs, None


@router.post("/fetch_weights")
async def fetch_weights(raw_request: Request):
    try:
        body = await raw_request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _error(400, "the body is not valid JSON")
    kwargs, bad = fetch_kwargs(body)
    if bad is not None:
        return bad
    engine = raw_request.app.state.engine_client
    try:
        result = await engine.collective_rpc("skyrl_fetch_weights", kwargs=kwargs)
    except Exception as e:   # the worker's refusal (InputError) crosses the RPC as its text
        m = _WORKER_ERROR.search(str(e))
        return _error(400, f"fetch_weights refused: {m.group(1) if m else e}")
    return JSONResponse(content={"status": "ok", "result": result})
