"""``skyrl_delta``: the delta store as a vLLM weight-transfer backend (worker and trainer side).

vLLM 0.32 drives weight updates of a running server through a pluggable backend
(``vllm.distributed.weight_transfer``) and four calls, over HTTP (dev mode) or Ray::

    init_weight_transfer_engine(init_info)   -> WeightTransferEngine.init_transfer_engine
    start_weight_update()                    -> .start_weight_update
    update_weights(update_info)              -> .receive_weights
    finish_weight_update(weight_version)     -> .finish_weight_update (+ the server's version)

This module plugs the delta store (``weight_sync.py``: XOR vs the previous version, zstd, a
manifest with per-tensor digests, HMAC-signed) in as backend ``skyrl_delta``, so one publish in a
directory or fsspec URL serves any number of servers and vLLM's own clients
(``HTTPVLLMWeightSyncClient``, ``RayVLLMWeightSyncClient``) drive it unchanged::

    vllm serve DIR --weight-transfer-config '{"backend": "skyrl_delta"}'   (+ VLLM_SERVER_DEV_MODE=1)

    init_info   {"store": "/path/or/fsspec-url", "weights_format": "native"}
    update_info {"version": 7}        (omitted: the newest version published)

SkyRL 0.4's dicts are taken too (``engine/skyrl_delta_compat.py``): an init naming
``base_model_path`` follows SkyRL's own checkpoint-delta store (``sync/skyrl_layout.py``) from
version 0 = the served checkpoint; its updates are ``{"target_version", "sync_dir", ...}`` and its
``/fetch_weights`` step (``engine/skyrl_fetch.py``) reads and verifies ahead of the update
(:meth:`SkyrlDeltaEngine.fetch_weights`). A server with a sync key refuses that init: SkyRL's
manifests carry no signature.

Registration: :func:`register` (called by our ``vllm.general_plugins`` entry point in every vLLM
process, and on import of this module for trainer processes) adds both sides to vLLM's factories.

Guarantees of the worker side (:class:`SkyrlDeltaEngine`):

* Nothing reaches the model until the whole chain of versions from the held one to the requested
  one is read and verified (manifest digest, HMAC when ``$SKYRL_NUMERICS_SYNC_KEY`` is set in the
  server's environment — the key never travels over HTTP —, names / dtypes / shapes against the
  served checkpoint, payload digests, order: no version at or below the held one is accepted, also
  after a re-init on the same store). A refusal raises :class:`~skyrl_numerics.errors.InputError`,
  which fails the HTTP call with its one-line reason; the receiver's bytes are rolled back and the
  served weights are untouched, bit for bit.
* Only whole blocks of changed tensors are loaded (vLLM reloads fused layers whole), through the
  one load path :func:`~skyrl_numerics.engine.weight_update.load_into_model` — every tensor of
  the receiver when the model serves another receiver's weights (after a switch of store or of
  dict family), so the served weights are always exactly one receiver's.
* ``$SKYRL_NUMERICS_REQUIRE_SYNC_KEY=1`` (set by ``skyrl-numerics serve`` on a non-loopback address)
  refuses to initialize without a key, so every manifest must carry a valid HMAC.
* The prefix cache is reset after ``finish_weight_update`` by the server-side patch in
  ``engine/vllm_patches.py`` (the scheduler is out of a worker's reach).

Cost: each worker's receiver holds one copy of the served checkpoint (the XOR base), as the
in-process generator does. The first update after start must be a full snapshot (the publisher
writes one as version 0).

Trainer side (:class:`SkyrlDeltaTrainerEngine`): ``trainer_init`` opens a
:class:`~skyrl_numerics.sync.weight_sync.DeltaPublisher` and initializes the servers;
``send_weights(state)`` publishes a version and drives start / update / finish, naming the version
as the server's ``weight_version``. A refusal comes back as ``InputError`` carrying the server's
reason.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from skyrl_numerics.engine.skyrl_delta_compat import (SkyrlInitInfo, SkyrlStream, SkyrlUpdateInfo,
                                                      is_skyrl_init, parse_init, parse_update)
from skyrl_numerics.errors import InputError
from skyrl_numerics.sync.skyrl_receiver import SkyrlDeltaReceiver

BACKEND = "skyrl_delta"
REQUIRE_KEY_ENV = "SKYRL_NUMERICS_REQUIRE_SYNC_KEY"
KEY_ENV = "SKYRL_NUMERICS_SYNC_KEY"


def register() -> None:
    """Add ``skyrl_delta`` to vLLM's worker and trainer factories (idempotent)."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "SkyrlDeltaEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, __name__, "SkyrlDeltaTrainerEngine")


# ---- worker side ----------------------------------------------------------------------------
@dataclass
class SkyrlDeltaInitInfo(WeightTransferInitInfo):
    store: str
    weights_format: str = "native"
    max_bytes: int | None = None


@dataclass
class SkyrlDeltaUpdateInfo(WeightTransferUpdateInfo):
    version: int | None = None


def _typed(cls, d: Any, what: str):
    """``cls(**d)`` with the project's error for unknown, missing or mistyped fields."""
    import dataclasses

    if not isinstance(d, dict):
        raise InputError(f"{what} must be a JSON object, got {type(d).__name__}", field=what)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise InputError(f"unknown key {unknown[0]!r} (known: {sorted(fields)})", field=what)
    for name, value in d.items():
        if name == "store" and not (isinstance(value, str) and value):
            raise InputError("store must be a non-empty path or URL string", field=f"{what}.store")
        if name in ("version", "max_bytes") and value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise InputError(f"{name} must be a non-negative integer, got {value!r}",
                             field=f"{what}.{name}")
    try:
        return cls(**d)
    except TypeError as e:
        raise InputError(str(e), field=what) from None


def checkpoint_dir(model: str):
    """The local directory of what vLLM serves: the path itself, or a Hugging Face hub id's
    snapshot in the local cache (vLLM downloaded it there; nothing is fetched here)."""
    from pathlib import Path

    if Path(model).is_dir():
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception:
        raise InputError(f"cannot find the served checkpoint {model!r} on this machine (a "
                         "directory or a cached hub snapshot) to check snapshots against",
                         field="model") from None


def served_layout(model_dir: str) -> dict[str, Any]:
    """``{name: meta tensor}`` of a checkpoint's ``*.safetensors`` (headers only): the names,
    dtypes and shapes a snapshot must match. ``model_dir``: a directory or a cached hub id."""
    import torch
    from safetensors import safe_open

    st_dtypes = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
                 "F64": torch.float64, "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16,
                 "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
                 "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
    out = {}
    root = checkpoint_dir(str(model_dir))
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise InputError(f"{root} has no *.safetensors: skyrl_delta checks every snapshot "
                         "against the served checkpoint's tensors", field="model")
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                sl = h.get_slice(name)
                dt = st_dtypes.get(sl.get_dtype())
                if dt is None:
                    raise InputError(f"dtype {sl.get_dtype()} of {name!r} is not supported by "
                                     "skyrl_delta", field=name, source=str(f))
                out[name] = torch.empty(sl.get_shape(), dtype=dt, device="meta")
    return out


class SkyrlDeltaEngine(WeightTransferEngine[SkyrlDeltaInitInfo, SkyrlDeltaUpdateInfo]):
    """Worker side of ``skyrl_delta`` (see the module docstring)."""

    init_info_cls = SkyrlDeltaInitInfo
    update_info_cls = SkyrlDeltaUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receiver = None
        self.store = None
        self._receivers: dict[str, Any] = {}     # store -> its receiver (the held version)
        self._high_water: dict[str, int] = {}   # store -> highest version ever applied
        self.last_update: dict[str, Any] = {}
        self.skyrl: SkyrlStream | None = None    # SkyRL's delta stream, when its init dict came
        self._skyrl_streams: dict[str, SkyrlStream] = {}   # base checkpoint -> its stream
        self._served_by = None   # the receiver whose weights the model serves (None: the checkpoint)

    def parse_init_info(self, init_dict: dict[str, Any]):
        if is_skyrl_init(init_dict):
            return parse_init(init_dict)
        return _typed(SkyrlDeltaInitInfo, init_dict, "init_info")

    def parse_update_info(self, update_dict: dict[str, Any]):
        if self.skyrl is not None:
            return parse_update(update_dict)
        return _typed(SkyrlDeltaUpdateInfo, update_dict, "update_info")

    def init_transfer_engine(self, init_info) -> None:
        from skyrl_numerics.sync.serving import check_format
        from skyrl_numerics.sync.weight_sync import DeltaReceiver

        key = os.environ.get(KEY_ENV) or None
        if os.environ.get(REQUIRE_KEY_ENV) == "1" and not key:
            raise InputError(f"this server requires signed manifests but {KEY_ENV} is not set "
                             "in its environment", field="init_info")
        if isinstance(init_info, SkyrlInitInfo):
            self._init_skyrl(init_info, key)
            return
        self.skyrl = None
        check_format(init_info.weights_format, field="init_info.weights_format")
        held = self._receivers.get(init_info.store)
        if held is not None and held.weights_format == init_info.weights_format:
            # a store seen before: its receiver keeps the version it holds (a re-init cannot
            # rewind it, and the next delta applies against it)
            self.receiver, self.store = held, init_info.store
            return
        self.receiver = DeltaReceiver(init_info.store, key=key, max_bytes=init_info.max_bytes,
                                      expect=self._expected_layout(),
                                      weights_format=init_info.weights_format)
        self.store = init_info.store
        self._receivers[init_info.store] = self.receiver

    def _init_skyrl(self, info: SkyrlInitInfo, key) -> None:
        """SkyRL's init dict: follow its store from version 0 = the served checkpoint (a stream
        seen before keeps the version it holds)."""
        from skyrl_numerics.invariant.numerics import engine_adapter_shapes

        if engine_adapter_shapes(self.model_config.hf_config):
            raise InputError("SkyRL's delta stream carries whole checkpoints; this engine serves "
                             "LoRA adapters only", field="init_info")
        served = os.path.realpath(checkpoint_dir(self.model_config.model))
        base = os.path.realpath(checkpoint_dir(info.base_model_path))
        if base != served:
            raise InputError(f"base_model_path {info.base_model_path!r} ({base}) is not the "
                             f"checkpoint this server serves ({served}): SkyRL's deltas apply to "
                             "their base checkpoint only", field="init_info.base_model_path")
        stream = self._skyrl_streams.get(base)
        if stream is None:
            stream = self._skyrl_streams[base] = SkyrlStream(info, base, key=key)
        stream.info = info
        self.skyrl, self.receiver, self.store = stream, None, None

    def fetch_weights(self, target_version: int, sync_dir: str | None = None,
                      uri: str | None = None) -> dict:
        """SkyRL's fetch step (before its pause): read and verify the chain up to
        ``target_version``; the served weights do not change."""
        if self.skyrl is None:
            raise InputError("fetch_weights is SkyRL's delta step: initialize with SkyRL's init "
                             "dict ({'base_model_path': ..., 'local_checkpoint_dir': ...}) first",
                             field="init_info")
        return self.skyrl.fetch(target_version, sync_dir, uri)

    def _expected_layout(self) -> dict:
        """What a snapshot must hold: the served checkpoint's tensors, or — an invariant engine
        serving a LoRA plan, whose base is frozen and packed — exactly its adapters (bf16)."""
        import torch

        from skyrl_numerics.invariant.numerics import engine_adapter_shapes

        shapes = engine_adapter_shapes(self.model_config.hf_config)
        if shapes:
            return {n: torch.empty(s, dtype=torch.bfloat16, device="meta") for n, s in shapes.items()}
        return served_layout(self.model_config.model)

    def start_weight_update(self) -> None:
        if self.receiver is None and self.skyrl is None:
            raise InputError("skyrl_delta is not initialized: call init_weight_transfer_engine "
                             "with {'store': ...} first", field="init_info")

    def finish_weight_update(self) -> None:
        pass

    def _chain(self, target: int | None) -> list[int]:
        """Versions to apply, in order, to go from the held version to ``target``: back from
        ``target`` along ``base_version`` to the held version or to a full snapshot."""
        from skyrl_numerics.sync.manifest import manifest_path, read_manifest, readable_versions

        r = self.receiver
        versions = readable_versions(r.store)   # another layout: InputError naming it
        if not versions:
            raise InputError(f"no version published in {self.store}", field="update_info.version")
        target = versions[-1] if target is None else target
        floor = max(r.version if r.version is not None else -1,
                    self._high_water.get(self.store, -1))
        if target <= floor:
            raise InputError(f"out of order: this server holds version {floor}; version "
                             f"{target} is not newer", field="update_info.version")
        chain, v = [], target
        while True:
            if v not in versions:
                raise InputError(f"version {v} is not published in {self.store} (newest: "
                                 f"{versions[-1]})", field="update_info.version")
            m = read_manifest(r.store, v, key=r.key)   # digest + HMAC: refused here if bad
            chain.append(v)
            if m.is_full or (r.version is not None and m.base_version == r.version):
                return chain[::-1]
            if m.base_version is None or m.base_version <= floor:
                raise InputError(f"delta {v} is against version {m.base_version}, which this "
                                 f"server cannot reach (it holds {r.version})",
                                 field="base_version", source=manifest_path(v))
            v = m.base_version

    def receive_weights(self, update_info) -> None:
        import time

        self.start_weight_update()
        t0 = time.perf_counter()
        if isinstance(update_info, SkyrlUpdateInfo):
            r = self.skyrl.receiver
            p = self.skyrl.apply(update_info)
            loaded = self._load(r, set(p.new_bytes), fresh=False)
            self.last_update = {"version": r.version, "versions": [m.version for m in p.manifests],
                                "format": "skyrl", "loaded": loaded, "payload_bytes": p.payload_nbytes,
                                "seconds": time.perf_counter() - t0}
            return
        r = self.receiver
        chain, changed, payload, held_version = self._apply_chain(r, update_info.version)
        loaded = self._load(r, changed, fresh=held_version is None)
        self._high_water[self.store] = r.version
        self.last_update = {"version": r.version, "versions": chain, "format": "skyrl_numerics",
                            "loaded": loaded,
                            "payload_bytes": payload, "seconds": time.perf_counter() - t0}

    def _apply_chain(self, r, target):
        """Commit the chain up to ``target`` into our receiver ``r``, all or nothing."""
        import numpy as np

        from skyrl_numerics.sync.codec import tensor_bytes

        chain = self._chain(target)
        held_version = r.version
        undo: dict[str, np.ndarray] = {}
        changed: set[str] = set()
        payload = 0
        try:
            for v in chain:
                prepared = r.prepare(v)
                if r.state:
                    for name in prepared.new_bytes:
                        if name not in undo:
                            undo[name] = tensor_bytes(r.state[name]).copy()
                r.commit(prepared)
                changed |= set(prepared.manifest.changed)
                payload += prepared.manifest.payload_nbytes
        except BaseException:
            for name, old in undo.items():
                np.copyto(tensor_bytes(r.state[name]), old)
            r.version = held_version
            if held_version is None:
                r._tensors = {}   # a fresh receiver keeps nothing of a refused chain
            raise
        return chain, changed, payload, held_version

    def _load(self, r, changed: set, *, fresh: bool):
        """Load the blocks of ``changed`` from receiver ``r`` into the model — all of ``r``'s
        tensors when it is fresh or when the model serves another receiver's weights (a SkyRL
        stream at version 0 holds the served checkpoint itself)."""
        from skyrl_numerics.engine.weight_update import (check_complete_blocks, expand_to_blocks,
                                                         load_into_model)

        state = r.state
        same = self._served_by is r or (self._served_by is None and isinstance(r, SkyrlDeltaReceiver))
        names = expand_to_blocks(changed, state) if (same and not fresh) else list(state)
        check_complete_blocks(names, state)
        loaded = load_into_model(self.vllm_config, self.model, ((n, state[n]) for n in names))
        self._served_by = r
        return loaded

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class ends with torch.accelerator.synchronize(), which has no CPU backend
        self.receive_weights(self.parse_update_info(update_info))

    def shutdown(self) -> None:
        self.receiver = None
        self.store = None
        self.skyrl = None
        self._receivers.clear()
        self._skyrl_streams.clear()


# ---- trainer side ---------------------------------------------------------------------------
@dataclass
class SkyrlDeltaTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND
    store: str = ""
    weights_format: str = "native"
    snapshot_every: int = 10
    key: str | None = field(default=None, repr=False)   # HMAC key (default $SKYRL_NUMERICS_SYNC_KEY)
    quantize: list | None = None   # serving formats: which weights (fnmatch patterns; default
                                   # linear projections and expert stacks, serving.make_selector)


def _server_reason(err: Exception) -> str:
    """The server's one-line reason inside an HTTP error (vLLM wraps worker errors)."""
    resp = getattr(err, "response", None)
    text = None
    if resp is not None:
        try:
            body = resp.json()
            text = (body.get("error") or {}).get("message") if isinstance(body.get("error"), dict) \
                else body.get("error") or body.get("detail") or body.get("message")
        except Exception:
            text = getattr(resp, "text", None)
    return " ".join(str(text or err).split())


def call_server(client, method: str, *args) -> None:
    """``client.<method>(*args)`` of a ``VLLMWeightSyncClient``; a failure is an ``InputError``
    carrying the server's one-line reason."""
    try:
        getattr(client, method)(*args)
    except Exception as e:
        raise InputError(f"server refused {method}: {_server_reason(e)}", field=method) from None


class SkyrlDeltaTrainerEngine(TrainerWeightTransferEngine[SkyrlDeltaTrainerInitInfo]):
    """Trainer side of ``skyrl_delta``: publish, then drive the servers' four-phase update."""

    init_info_cls = SkyrlDeltaTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: SkyrlDeltaTrainerInitInfo, *, client, source=None):
        from skyrl_numerics.sync.weight_sync import DeltaPublisher

        if not init_info.store:
            raise InputError("store must name a directory or fsspec URL", field="store")
        eng = cls(client=client, source=source, is_sender=init_info.is_sender)
        eng.init_info = init_info
        eng.publisher = (DeltaPublisher(init_info.store, snapshot_every=init_info.snapshot_every,
                                        weights_format=init_info.weights_format,
                                        key=init_info.key, quantize=init_info.quantize)
                         if init_info.is_sender else None)
        eng.last_manifest = None
        if init_info.is_sender:
            eng._call("init_weight_transfer_engine",
                      {"store": init_info.store, "weights_format": init_info.weights_format})
        return eng

    def _call(self, method: str, *args) -> None:
        call_server(self.client, method, *args)

    def send_weights(self, state: Mapping[str, Any] | None = None, *, full: bool = False):
        """Publish ``state`` (checkpoint names -> tensors; default: the ``source`` given at init)
        as the next version and load it into every server. Returns the manifest (on non-sender
        ranks ``None``)."""
        if state is None:
            if self.source is None:
                raise InputError("send_weights needs a state or a source", field="state")
            state = dict(iter(self.source))
        if not self.is_sender:
            return None
        m = self.publisher.publish(state, full=full or self.last_manifest is None)
        self.last_manifest = m
        self._call("start_weight_update")
        self._call("update_weights", {"version": m.version})
        self._call("finish_weight_update", str(m.version))
        return m


register()


def http_client(url: str, api_key: str | None = None, timeout: float = 300):
    """vLLM's own ``HTTPVLLMWeightSyncClient`` for ``url``; with ``api_key`` (a server behind
    ``--api-key``, whose control routes our plugin guards) each call also sends
    ``Authorization: Bearer <key>`` — the stock client sends no header at all."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    if not api_key:
        return HTTPVLLMWeightSyncClient(url, timeout=timeout)

    class _KeyedClient(HTTPVLLMWeightSyncClient):
        def _post(self, path, json=None):
            import requests

            r = requests.post(f"{self.base_url}/{path}", json=json, timeout=self.timeout,
                              headers={"Authorization": f"Bearer {api_key}"})
            r.raise_for_status()

    return _KeyedClient(url, timeout=timeout)
