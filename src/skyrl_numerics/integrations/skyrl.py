"""SkyRL 0.4's unchanged ``RemoteInferenceClient`` against a keyed ``skyrl-numerics serve``.

SkyRL's HTTP client sends no ``Authorization`` header: every request goes through one
``aiohttp.ClientSession`` per event loop, made by ``RemoteGenerateClient._get_session`` with no
default headers (data plane: ``/inference/v1/generate``, ``/skyrl/v1/generate``, ``/detokenize``;
control plane: ``/pause``, ``/resume``, ``/fetch_weights``, ``/collective_rpc``, ...). Against a
server started with ``--api-key`` (required off loopback) every call is 401.

:class:`KeyedRemoteInferenceClient` is SkyRL's class with one more field, ``api_key``: its
generate client (:class:`KeyedGenerateClient`) adds ``Authorization: Bearer <key>`` to the
default headers of every session it makes, so every call of every method carries it. Nothing of
SkyRL's code is changed. The key is a dataclass field (``repr=False``): it travels with the client
when SkyRL pickles it to another process. In a SkyRL experiment, override its hook::

    class MyExp(BasePPOExp):
        def get_inference_client(self):
            return keyed_client(super().get_inference_client())   # key: $VLLM_API_KEY

SkyRL's blocking weight-sync control plane, ``SkyrlWeightSyncClient`` (``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``, ``/fetch_weights``; its
delta trainer engine takes it as ``client=``), posts through one ``requests.Session`` it owns:
:class:`KeyedWeightSyncClient` is that class whose session sends the key::

    client = KeyedWeightSyncClient([server_url])                         # key: $VLLM_API_KEY
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client)

Both classes reach into one private attribute of SkyRL 0.4.0 (the session's maker / the session):
pinned to that release, like the tests that run them (tests/integrations).
"""
from __future__ import annotations

import dataclasses
import os

from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import (
    RemoteGenerateClient,
    RemoteInferenceClient,
)
from skyrl.backends.skyrl_train.weight_sync.control_plane import SkyrlWeightSyncClient

from skyrl_numerics.errors import InputError

__all__ = ["KeyedGenerateClient", "KeyedRemoteInferenceClient", "KeyedWeightSyncClient", "keyed_client"]


def _bearer(api_key: str) -> str:
    return f"Bearer {api_key}"


@dataclasses.dataclass
class KeyedGenerateClient(RemoteGenerateClient):
    """SkyRL's ``RemoteGenerateClient`` whose sessions send the API key."""

    api_key: str = dataclasses.field(default="", repr=False)

    async def _get_session(self):
        session = await super()._get_session()
        session.headers["Authorization"] = _bearer(self.api_key)
        return session


@dataclasses.dataclass
class KeyedRemoteInferenceClient(RemoteInferenceClient):
    """SkyRL's ``RemoteInferenceClient`` that sends ``api_key`` on every call (module doc)."""

    api_key: str = dataclasses.field(default="", repr=False)

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.api_key, str) or not self.api_key:
            raise InputError("an API key is needed (pass api_key= or set VLLM_API_KEY)",
                             field="api_key")

    def _get_generate_client(self) -> KeyedGenerateClient:
        if self._generate_client is None:
            self._generate_client = KeyedGenerateClient(proxy_url=self.proxy_url,
                                                        api_key=self.api_key)
        return self._generate_client


def keyed_client(client: RemoteInferenceClient, api_key: str | None = None
                 ) -> KeyedRemoteInferenceClient:
    """``client`` (a SkyRL ``RemoteInferenceClient``, e.g. what ``BasePPOExp.get_inference_client``
    built) as a :class:`KeyedRemoteInferenceClient` with the same settings; ``api_key`` defaults to
    ``$VLLM_API_KEY``. The client given is not changed (its open sessions stay unkeyed)."""
    if not isinstance(client, RemoteInferenceClient):
        raise InputError(f"expected SkyRL's RemoteInferenceClient, got {type(client).__name__}",
                         field="client")
    key = api_key if api_key is not None else os.environ.get("VLLM_API_KEY", "")
    kept = {f.name: getattr(client, f.name) for f in dataclasses.fields(client)
            if f.init and f.name not in ("_generate_client", "_gen_sem", "_detok_sem", "_sem_loop",
                                          "api_key")}
    return KeyedRemoteInferenceClient(**kept, api_key=key)


def _key_or_env(api_key: str | None) -> str:
    key = api_key if api_key is not None else os.environ.get("VLLM_API_KEY", "")
    if not isinstance(key, str) or not key:
        raise InputError("an API key is needed (pass api_key= or set VLLM_API_KEY)", field="api_key")
    return key


class KeyedWeightSyncClient(SkyrlWeightSyncClient):
    """SkyRL's ``SkyrlWeightSyncClient`` whose every call sends ``Authorization: Bearer <key>``
    (``api_key``, default ``$VLLM_API_KEY``); the other arguments are SkyRL's own (module doc)."""

    def __init__(self, server_urls, *args, api_key: str | None = None, **kw):
        key = _key_or_env(api_key)
        super().__init__(server_urls, *args, **kw)
        self._session.headers["Authorization"] = _bearer(key)

    def __repr__(self) -> str:          # never the key
        return f"KeyedWeightSyncClient({self._urls!r})"
