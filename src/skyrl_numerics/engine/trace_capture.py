"""Per-row tensor digests of one forward's modules (the tracer's capture, both sides) and the
engine side of it: the worker mixin (:class:`TraceMixin`) and :func:`engine_trace`.

**What is recorded.** Every tensor a hook of :mod:`.trace_roles` hands over is cut into token
rows (``[rows, ...]``, an HF batch of one squeezed), each row converted to float32 (exact from
bf16/fp16; integer ids exactly below 2**24) and filed under ``(request, position)``:

- a digest of the row (:func:`skyrl_numerics.gap.digest.row_digests`: 16 bytes of the float32
  bytes, little-endian), ``max|x|`` and the row's sum (float64) — always;
- the float32 row itself, only with ``keep_tensors`` (the comparator then measures max |Δ|, ulps
  and the share of elements that differ; without it, only which rows differ and the stats).

Rows are placed by a :class:`RowLayout`: the trainer side sets one sequence's positions
``0 .. T-1``; in a vLLM worker it is read from the model runner at each hooked call, as route
capture does (``route_store.py``): row ``t`` of request ``b`` (``input_batch`` order) is position
``runner.positions[t]``. A tensor with one row per request (the logits: vLLM computes them for
the sampled rows only) is placed at each request's last scheduled position.

**vLLM's schedule.** Each forward the worker sees (its first hooked tensor) is logged as a step:
per request its first position, its scheduled token count and the kind — ``prefill`` (the whole
prompt at once), ``chunk`` (part of a prompt: chunked prefill), ``decode`` (after the prompt).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from skyrl_numerics.gap.digest import DIGEST_BYTES, row_digests
from skyrl_numerics.hashing import default_algo

from .sampled_rows import external_id
from .trace_roles import hook_invariant, hook_modules


@dataclass
class RowLayout:
    """Which ``(request, position)`` each row of a forward's token tensors is, and each row of
    a per-request tensor (``sampled``)."""
    reqs: list                 # request key per request index
    req_of_row: np.ndarray     # [rows] request index per token row
    pos: np.ndarray            # [rows] position per token row
    sampled: np.ndarray        # [m] the position of each per-request row
    sampled_req: np.ndarray    # [m] its request index

    @classmethod
    def sequence(cls, key, length: int) -> "RowLayout":
        """One whole sequence ``0 .. length-1``; its per-request rows: every position (a
        trainer computes the logits of all of them)."""
        pos = np.arange(length, dtype=np.int64)
        return cls([key], np.zeros(length, np.int64), pos, pos, np.zeros(length, np.int64))


@dataclass
class _Rows:
    """The rows of one canonical name and one request, in arrival order."""
    pos: list = field(default_factory=list)
    digest: list = field(default_factory=list)
    max_abs: list = field(default_factory=list)
    sum: list = field(default_factory=list)
    rows: list = field(default_factory=list)


class TraceRecorder:
    """Collects :meth:`record` calls (see the module) until :meth:`fetch`."""

    def __init__(self, keep_tensors: bool = False, algo: str | None = None, layout_fn=None,
                 step_fn=None):
        self.keep_tensors = bool(keep_tensors)
        self.algo = algo or default_algo()
        self.layout: RowLayout | None = None
        self.layout_fn = layout_fn     # () -> RowLayout, called per record (a worker)
        self.step_fn = step_fn         # (layout) -> None, at each forward's first tensor
        self.first_name: str | None = None
        self.data: dict[str, dict] = {}     # name -> request key -> _Rows
        self.widths: dict[str, int] = {}
        self.dtypes: dict[str, str] = {}
        self.seconds = 0.0
        self.notes: list[str] = []

    def record(self, name: str, t) -> None:
        if t is None:
            return
        t0 = time.perf_counter()
        try:
            self._record(name, t)
        finally:
            self.seconds += time.perf_counter() - t0

    def _record(self, name: str, t) -> None:
        import torch

        if self.layout_fn is not None:
            self.layout = self.layout_fn()
        lay = self.layout
        if lay is None or len(lay.pos) == 0:
            return
        if self.first_name is None:
            self.first_name = name
        if name == self.first_name and self.step_fn is not None:
            self.step_fn(lay)
        x = t.detach()
        if x.dim() >= 3 and x.shape[0] == 1:      # an HF batch of one
            x = x[0]
        x = x.reshape(x.shape[0], -1) if x.dim() >= 1 else x.reshape(1, 1)
        n_tok = len(lay.pos)
        if x.shape[0] >= n_tok:
            x, req_of_row, pos = x[:n_tok], lay.req_of_row, lay.pos
        elif x.shape[0] == len(lay.sampled):
            req_of_row, pos = lay.sampled_req, lay.sampled
        else:
            self.notes.append(f"{name}: {x.shape[0]} rows for {n_tok} tokens / "
                              f"{len(lay.sampled)} sampled rows (left out)")
            return
        self.dtypes.setdefault(name, str(t.dtype).replace("torch.", ""))
        rows = x.to(torch.float32).cpu().contiguous().numpy()
        self.widths[name] = rows.shape[1]
        dig = row_digests(rows, self.algo)
        mx = np.abs(rows).max(axis=1).astype(np.float64) if rows.shape[1] else np.zeros(len(rows))
        sm = rows.sum(axis=1, dtype=np.float64)
        by_req = self.data.setdefault(name, {})
        for b in np.unique(req_of_row):
            sel = req_of_row == b
            r = by_req.setdefault(lay.reqs[int(b)], _Rows())
            r.pos.append(pos[sel])
            r.digest.append(dig[sel])
            r.max_abs.append(mx[sel])
            r.sum.append(sm[sel])
            if self.keep_tensors:
                r.rows.append(rows[sel].copy())

    def fetch(self, keys: list) -> dict:
        """What was recorded for the request ``keys`` (in that order), as plain types: ``{name:
        {"width", "dtype", "seqs": [{"pos", "digest", "max_abs", "sum", "rows"} bytes | None]}}``
        (a later row of the same position replaces an earlier one)."""
        out = {}
        for name, by_req in self.data.items():
            seqs = []
            for key in keys:
                r = by_req.get(key)
                if r is None:
                    seqs.append(None)
                    continue
                pos = np.concatenate(r.pos)
                _, last = np.unique(pos[::-1], return_index=True)
                keep = np.sort(len(pos) - 1 - last)
                order = keep[np.argsort(pos[keep], kind="stable")]
                pick = lambda parts: np.concatenate(parts)[order]  # noqa: E731
                seqs.append({"pos": pos[order].astype("<i8").tobytes(),
                             "digest": pick(r.digest).astype(np.uint8).tobytes(),
                             "max_abs": pick(r.max_abs).astype("<f8").tobytes(),
                             "sum": pick(r.sum).astype("<f8").tobytes(),
                             "rows": pick(r.rows).astype("<f4").tobytes() if r.rows else None})
            out[name] = {"width": self.widths[name], "dtype": self.dtypes[name], "seqs": seqs}
        return out


def decode_seq(got: dict, width: int) -> dict:
    """One ``fetch`` entry back as arrays: pos [n], digest [n, 16], max_abs [n], sum [n], rows
    [n, width] or None (fields given as base64 text are decoded first)."""
    if isinstance(got.get("pos"), str):
        import base64

        got = {k: base64.b64decode(v) if isinstance(v, str) else v for k, v in got.items()}
    pos = np.frombuffer(got["pos"], "<i8").astype(np.int64)
    return {"pos": pos,
            "digest": np.frombuffer(got["digest"], np.uint8).reshape(-1, DIGEST_BYTES),
            "max_abs": np.frombuffer(got["max_abs"], "<f8").astype(np.float64),
            "sum": np.frombuffer(got["sum"], "<f8").astype(np.float64),
            "rows": (np.frombuffer(got["rows"], "<f4").reshape(len(pos), width)
                     if got.get("rows") else None)}


# ---- inside a vLLM worker ---------------------------------------------------------------------

def runner_layout(runner) -> RowLayout:
    """The current forward's rows (``input_batch`` order; see the module)."""
    ib = runner.input_batch
    n_req = ib.num_reqs
    qsl = np.asarray(runner.query_start_loc.np[: n_req + 1], dtype=np.int64)
    n = int(qsl[-1]) if n_req else 0
    pos = runner.positions[:n].cpu().numpy().astype(np.int64)
    req_of_row = np.repeat(np.arange(n_req), np.diff(qsl))
    live = np.flatnonzero(np.diff(qsl) > 0)
    sampled = pos[qsl[live + 1] - 1] if n else np.zeros(0, np.int64)
    return RowLayout(list(ib.req_ids[:n_req]), req_of_row, pos, sampled, live)


def step_kinds(runner, lay: RowLayout) -> list:
    """``[request id, first position, tokens, kind]`` per request of a forward."""
    prompt_lens = getattr(runner.input_batch, "num_prompt_tokens", None)
    out = []
    for b, req in enumerate(lay.reqs):
        p = lay.pos[lay.req_of_row == b]
        if not len(p):
            continue
        start, count = int(p.min()), int(len(p))
        plen = int(prompt_lens[b]) if prompt_lens is not None else None
        if plen is None:
            kind = "unknown"
        elif start >= plen:
            kind = "decode"
        elif start == 0 and count >= plen:
            kind = "prefill"
        else:
            kind = "chunk"
        out.append([external_id(req), start, count, kind])
    return out


class TraceMixin:
    """The tracer's worker side: hooks on the live model (``trace_roles.py``), a
    :class:`TraceRecorder` placing rows by the runner's batch, the schedule of each forward and
    each request's prompt ids (how a server's requests are matched to the sequences)."""

    def skyrl_trace_start(self, per_op: bool, keep_tensors: bool) -> dict:
        self.skyrl_trace_stop()
        runner = self.model_runner
        model = runner.get_model()
        steps: list = []
        prompts: dict = {}

        def step(lay):
            steps.append(step_kinds(runner, lay))
            ib = runner.input_batch
            for b, req in enumerate(lay.reqs):
                if req not in prompts:
                    n = int(ib.num_prompt_tokens[b])
                    prompts[req] = [int(t) for t in ib.token_ids_cpu[b, :n]]
        rec = TraceRecorder(keep_tensors, layout_fn=lambda: runner_layout(runner), step_fn=step)
        core = getattr(model, "core", None)
        if core is not None and hasattr(core, "forward_tokens"):
            unhook, kind = hook_invariant(core, rec.record, per_op), "invariant"
        else:
            cfg = self.vllm_config.model_config.hf_config
            unhook, kind = hook_modules(model, "vllm", cfg, rec.record, per_op), "vllm"
        self._skyrl_trace = (rec, unhook, steps, prompts)
        return {"kind": kind, "algo": rec.algo,
                "layers": int(self.vllm_config.model_config.get_total_num_hidden_layers())}

    def skyrl_trace_fetch(self, external_ids: list[str] | None = None, b64: bool = False) -> dict:
        """The records of ``external_ids`` (in that order); ``None``: of every request seen, in
        order of arrival, with their ids (``keys``) and prompt ids (``prompts``). ``b64``: bytes
        as base64 text (a JSON reply: ``/collective_rpc`` of a server)."""
        rec, _, steps, prompts = self._skyrl_trace
        out = {"steps": list(steps), "capture_s": rec.seconds, "notes": list(rec.notes)}
        if external_ids is None:
            keys = list(prompts)
            out["keys"] = [external_id(k) for k in keys]
            out["prompts"] = [prompts[k] for k in keys]
        else:
            by_ext = {external_id(req): req for req in prompts}
            keys = [by_ext.get(e) for e in external_ids]
        out["modules"] = rec.fetch(keys)
        if b64:
            import base64

            for m in out["modules"].values():
                for seq in m["seqs"]:
                    for k, v in (seq or {}).items():
                        if isinstance(v, bytes):
                            seq[k] = base64.b64encode(v).decode()
        return out

    def skyrl_trace_stop(self) -> None:
        got = getattr(self, "_skyrl_trace", None)
        if got is None:
            return
        got[1]()
        self._skyrl_trace = None


def engine_trace(gen, sequences: list, *, per_op: bool = False, keep_tensors: bool = False,
                 decode: int = 0) -> dict:
    """Run ``sequences`` (token-id lists) through ``gen``'s engine (a :class:`VLLMGenerator`)
    under the worker's trace hooks: one request per sequence, greedy, ``1 + decode`` tokens
    (``decode`` > 0 traces decode steps too), the prefix cache reset first so every position is
    computed. Returns the worker's :meth:`TraceMixin.skyrl_trace_fetch` plus ``sequences`` (each
    prompt with the ``decode`` tokens the engine generated and ran), ``kind``, ``algo``,
    ``layers`` and ``forward_s`` (the generate call's wall time)."""
    from vllm import SamplingParams

    llm = gen.llm
    llm.reset_prefix_cache()
    info = llm.collective_rpc("skyrl_trace_start", args=(bool(per_op), bool(keep_tensors)))[0]
    try:
        params = SamplingParams(max_tokens=1 + int(decode), temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": list(map(int, s))} for s in sequences], params,
                            use_tqdm=False)
        forward_s = time.perf_counter() - t0
        got = llm.collective_rpc("skyrl_trace_fetch", args=([o.request_id for o in outs],))[0]
    finally:
        llm.collective_rpc("skyrl_trace_stop")
    ran = [list(map(int, s)) + list(o.outputs[0].token_ids)[: int(decode)]
           for s, o in zip(sequences, outs)]
    return {**got, **info, "sequences": ran, "forward_s": forward_s}


def server_trace(remote, sequences: list, *, per_op: bool = False, keep_tensors: bool = False,
                 decode: int = 0) -> dict:
    """:func:`engine_trace` against a ``vllm serve`` server with our worker extension (a
    :class:`~.remote.RemoteGenerator`; dev mode: ``/collective_rpc``, ``/reset_prefix_cache``):
    one ``/v1/completions`` request per sequence, sent together, greedy; the worker's records
    matched to the sequences by their prompt ids."""
    from concurrent.futures import ThreadPoolExecutor

    remote.reset_prefix_cache()
    info = remote.rpc("skyrl_trace_start", bool(per_op), bool(keep_tensors))

    def one(seq):
        return remote.client.completions.create(
            model=remote.model, prompt=[list(map(int, seq))], max_tokens=1 + int(decode),
            temperature=0.0, extra_body={"return_token_ids": True, "ignore_eos": True})
    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max(1, min(16, len(sequences)))) as pool:
            resps = list(pool.map(one, sequences))
        forward_s = time.perf_counter() - t0
        got = remote.rpc("skyrl_trace_fetch", None, True)
    finally:
        remote.rpc("skyrl_trace_stop")
    index = {tuple(p): j for j, p in enumerate(got["prompts"])}
    missing = [i for i, s in enumerate(sequences) if tuple(map(int, s)) not in index]
    if missing:
        raise RuntimeError(f"server trace: the worker saw no request for sequence {missing[0]}")
    pick = [index[tuple(map(int, s))] for s in sequences]
    got["modules"] = {n: {**m, "seqs": [m["seqs"][j] for j in pick]}
                      for n, m in got["modules"].items()}
    ran = []
    for s, r in zip(sequences, resps):
        toks = [int(t) for t in (r.choices[0].model_extra or {}).get("token_ids") or []]
        ran.append(list(map(int, s)) + toks[: int(decode)])
    return {**got, **info, "sequences": ran, "forward_s": forward_s}
