"""SkyRL 0.4's delta weight sync on our ``skyrl_delta`` backend: its init and update dicts and its
``fetch_weights`` step, over its own store (``sync/skyrl_layout.py``).

SkyRL's unchanged trainer engine (``DeltaTrainerWeightTransferEngine``, ``weight_sync/delta/
trainer.py``) and its control-plane client (``SkyrlWeightSyncClient``) drive a server so::

    POST /init_weight_transfer_engine  {"init_info": {"base_model_path", "local_checkpoint_dir",
            "cloud_download_workers", "checkpoint_load_format", "multi_thread_safetensors_max_workers"}}
    per update, after publishing delta-<v>/ under sync_dir:
    POST /fetch_weights  {"target_version": v, "sync_dir": ..., ["uri": ...]}     before the pause
    POST /pause?mode=keep, /start_weight_update,
         /update_weights {"update_info": {"target_version": v, "version": v, "sync_dir", "uri"}},
         /finish_weight_update (no weight_version), /resume

Here (:class:`SkyrlStream`): the init builds a :class:`~skyrl_numerics.sync.skyrl_receiver.
SkyrlDeltaReceiver` holding version 0 = the served checkpoint (``base_model_path`` must be it: a
delta applies to its base only); ``fetch_weights`` reads and verifies the whole chain up to
``target_version`` while the server still generates (``prepare``: nothing changes); the update
commits what was fetched (or fetches it then) and the engine loads the changed blocks.
``local_checkpoint_dir``, ``checkpoint_load_format`` and the safetensors worker count are checked
and recorded but not used: the receiver holds the weights in memory (one copy, the XOR base) and
loads through the one load path, not from a checkpoint copy on disk.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

from skyrl_numerics.errors import InputError
from skyrl_numerics.sync.skyrl_receiver import SkyrlDeltaReceiver, SkyrlPrepared

#: SkyRL 0.4's ``SUPPORTED_CHECKPOINT_LOAD_FORMATS`` (delta/checkpoint.py)
LOAD_FORMATS = ("vllm_fastsafetensors", "vllm_multi_thread_safetensors")


@dataclass
class SkyrlInitInfo(WeightTransferInitInfo):
    """SkyRL's ``DeltaTransferInitInfo`` (the dict its trainer engine sends at init)."""

    base_model_path: str
    local_checkpoint_dir: str
    cloud_download_workers: int = 4
    checkpoint_load_format: str = "vllm_multi_thread_safetensors"
    multi_thread_safetensors_max_workers: int = 8


@dataclass
class SkyrlUpdateInfo(WeightTransferUpdateInfo):
    """SkyRL's ``DeltaTransferUpdateInfo`` (its publisher's return dict)."""

    target_version: int | None = None
    version: int | None = None
    sync_dir: str | None = None
    uri: str | None = None


_STR = ("base_model_path", "local_checkpoint_dir", "checkpoint_load_format")
_POS_INT = ("cloud_download_workers", "multi_thread_safetensors_max_workers")


def _typed(cls, d: Any, what: str):
    if not isinstance(d, dict):
        raise InputError(f"{what} must be a JSON object, got {type(d).__name__}", field=what)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(d) - set(names))
    if unknown:
        raise InputError(f"unknown key {unknown[0]!r} (SkyRL's keys: {names})", field=what)
    for k, v in d.items():
        if k in _STR and not (isinstance(v, str) and v):
            raise InputError(f"{k} must be a non-empty string, got {v!r}", field=f"{what}.{k}")
        if k in ("sync_dir", "uri") and v is not None and not (isinstance(v, str) and v):
            raise InputError(f"{k} must be a non-empty string or null, got {v!r}", field=f"{what}.{k}")
        if (k in _POS_INT or k in ("target_version", "version")) and v is not None and (
                isinstance(v, bool) or not isinstance(v, int) or v < (1 if k in _POS_INT else 0)):
            raise InputError(f"{k} must be a {'positive' if k in _POS_INT else 'non-negative'} "
                             f"integer, got {v!r}", field=f"{what}.{k}")
    try:
        return cls(**d)
    except TypeError as e:
        raise InputError(str(e), field=what) from None


def parse_init(d: Any) -> SkyrlInitInfo:
    info = _typed(SkyrlInitInfo, d, "init_info")
    if info.checkpoint_load_format not in LOAD_FORMATS:
        raise InputError(f"checkpoint_load_format {info.checkpoint_load_format!r} is not one of "
                         f"{', '.join(LOAD_FORMATS)}", field="init_info.checkpoint_load_format")
    return info


def parse_update(d: Any) -> SkyrlUpdateInfo:
    info = _typed(SkyrlUpdateInfo, d, "update_info")
    target = info.target_version if info.target_version is not None else info.version
    if target is None:
        raise InputError("SkyRL's update_info needs target_version", field="update_info.target_version")
    if info.version is not None and info.version != target:
        raise InputError(f"version {info.version} and target_version {target} differ",
                         field="update_info.version")
    info.target_version = target
    return info


def is_skyrl_init(d: Any) -> bool:
    """Whether an init dict is SkyRL's (it names ``base_model_path``; ours names ``store``)."""
    return isinstance(d, dict) and "base_model_path" in d


class SkyrlStream:
    """One SkyRL delta stream followed by a server: the receiver (version 0 = the served
    checkpoint ``base_dir``) and the chain fetched ahead of the update."""

    def __init__(self, info: SkyrlInitInfo, base_dir: str, *, key=None):
        self.info = info
        self.receiver = SkyrlDeltaReceiver(None, base_dir, key=key,
                                           io_workers=info.cloud_download_workers)
        self.fetched: SkyrlPrepared | None = None

    def fetch(self, target_version: int, sync_dir: str | None = None, uri: str | None = None) -> dict:
        """Read and verify every version up to ``target_version`` (the weights do not change)."""
        self.fetched = None
        p = self.receiver.prepare(target_version, sync_dir, uri)
        self.fetched = p
        return {"status": "ok", "target_version": p.version,
                "stats": {"fetch_s": p.fetch_s, "payload_bytes": p.payload_nbytes,
                          "versions": [m.version for m in p.manifests]}}

    def apply(self, update: SkyrlUpdateInfo) -> SkyrlPrepared:
        """Commit version ``update.target_version``: what :meth:`fetch` prepared for it (same
        store), else read and verify it now. Returns what was committed."""
        p = self.fetched
        self.fetched = None
        if p is None or p.version != update.target_version or p.base_version != self.receiver.version \
                or (update.sync_dir is not None and p.root.rstrip("/") != update.sync_dir.rstrip("/")):
            p = self.receiver.prepare(update.target_version, update.sync_dir, update.uri)
        return self.receiver.commit(p)
