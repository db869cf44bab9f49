"""``engine/skyrl_route.py`` without a server: the endpoint plugin our patch hands vLLM attaches
``/skyrl/v1/generate`` only to servers started with our worker extension (SkyRL's own servers add their
own route) and only for the ``generate`` task; the body checks name the field."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from skyrl_numerics.host import vllm_version

pytest.importorskip("vllm")


def test_the_plugin_is_loaded_for_generate_and_attached_to_our_servers_only():
    import vllm.plugins as plugins
    from fastapi import FastAPI

    from skyrl_numerics.engine import vllm_patches
    from skyrl_numerics.engine.server import WORKER_EXTENSION
    from skyrl_numerics.engine.skyrl_route import SKYRL_GENERATE, SkyrlEndpoints

    with vllm_patches.patched():
        assert [type(p) for p in plugins.load_endpoint_plugins(("generate",))] == [SkyrlEndpoints]
        assert plugins.load_endpoint_plugins(("embed",)) == []
        assert plugins.load_endpoint_plugins(None) == []
    for ext, attached in ((WORKER_EXTENSION, True), ("skyrl.backends.other.Extension", False), (None, False)):
        app = FastAPI()
        app.state.args = SimpleNamespace(worker_extension_cls=ext)
        SkyrlEndpoints().attach_router(app)
        paths = {getattr(r, "path", None) for r in app.routes}
        assert (SKYRL_GENERATE in paths) is attached and ("/fetch_weights" in paths) is attached, ext


@pytest.mark.parametrize("body,field", [
    ([], "body"),
    ({"token_ids": [1], "return_sample_support": 1}, "return_sample_support"),
    ({"token_ids": [1], "return_sample_support": True, "sampling_params": {"top_k": True}},
     "sampling_params.top_k"),
    ({"token_ids": [1], "return_sample_support": True, "sampling_params": {"top_k": 8, "temperature": "1"}},
     "sampling_params.temperature"),
    ({"token_ids": [-1]}, "token_ids"),
    ({"token_ids": [1], "cache_salt": ""}, "cache_salt"),
    ({"token_ids": [1], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"token_ids": [1], "sampling_params": {"max_tokens": 0}}, "sampling_params.max_tokens"),
    ({"token_ids": [1], "sampling_params": {"top_k": -5}}, "sampling_params"),
])
def test_bad_bodies_name_the_field(body, field):
    from skyrl_numerics.engine.skyrl_route import SkyrlCall
    from skyrl_numerics.errors import InputError

    with pytest.raises(InputError) as e:
        SkyrlCall.parse(body, max_logprobs=64)
    assert e.value.field == field, str(e.value)


def test_a_support_request_asks_for_2k_plus_1_logprobs():
    from skyrl_numerics.engine.skyrl_route import SkyrlCall

    call = SkyrlCall.parse({"token_ids": [3, 4], "return_sample_support": True, "model": "m",
                            "sampling_params": {"top_k": 16, "logprobs": 0, "seed": 1}}, max_logprobs=64)
    assert call.support and call.n_logprobs == 33 and call.request.sampling_params.logprobs == 33
    assert call.request.sampling_params.seed == 1 and call.request.token_ids == [3, 4]
    capped = SkyrlCall.parse({"token_ids": [3], "return_sample_support": True,
                              "sampling_params": {"top_k": 40}}, max_logprobs=64)
    assert capped.n_logprobs == 64
    plain = SkyrlCall.parse({"token_ids": [3], "sampling_params": {"logprobs": 0}}, max_logprobs=64)
    assert not plain.support and plain.request.sampling_params.logprobs == 0


CANDIDATES = [(9, -0.5), (4, -1.25), (7, -1.25), (2, -9999.0)]   # the floor is -inf: outside


def test_top_logprob_ids_are_read_from_the_old_wire_shape():
    """vLLM 0.30/0.31's generate endpoint sends ``ChatCompletionLogProb`` with the placeholder
    ``token="token_id:<id>"`` and no rank (seen on 0.31: the route failed with
    "'ChatCompletionLogProb' object has no attribute 'token_id'"); 0.32 still has the class. The
    support comes back in rank order (by logprob, ties by id)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionLogProb

    from skyrl_numerics.engine.skyrl_route import _support_rows, candidate_id
    from skyrl_numerics.errors import InputError

    old = [ChatCompletionLogProb(token=f"token_id:{t}", logprob=lp) for t, lp in reversed(CANDIDATES)]
    assert [candidate_id(e) for e in old] == [2, 7, 4, 9]
    assert _support_rows([SimpleNamespace(top_logprobs=old)], n_logprobs=4) == [[9, 4, 7]]
    with pytest.raises(InputError, match="'hello' is not 'token_id:<id>'") as e:
        candidate_id(ChatCompletionLogProb(token="hello", logprob=-1.0))
    assert e.value.field == "logprobs"


def test_top_logprob_ids_are_read_from_the_new_wire_shape():
    """vLLM 0.32's generate endpoint sends ``GenerateLogProb(token_id, logprob, rank)`` (0.30/0.31
    do not have the class: skipped there, found by ``make compat``'s side venvs); the same support
    as the old shape gives."""
    import vllm.entrypoints.scale_out.token_in_token_out.protocol as protocol

    from skyrl_numerics.engine.skyrl_route import _support_rows, candidate_id

    if not hasattr(protocol, "GenerateLogProb"):
        pytest.skip(f"vLLM {vllm_version()} has no GenerateLogProb (0.32's generate wire shape)")
    new = [protocol.GenerateLogProb(token_id=t, logprob=lp, rank=r + 1) for r, (t, lp) in enumerate(CANDIDATES)]
    assert [candidate_id(e) for e in new] == [9, 4, 7, 2]
    assert _support_rows([SimpleNamespace(top_logprobs=new)], n_logprobs=4) == [[9, 4, 7]]
