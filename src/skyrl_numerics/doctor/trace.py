"""``skyrl-numerics trace``: where two forwards of the same token sequences first part, layer by
layer (and, with ``per_op``, op by op).

Sides (:data:`SIDES`): the HF trainer (``hf``: transformers, bf16), the HF trainer under
:func:`skyrl_numerics.kernels.batch_invariant_mode` (``hf-mode``), the invariant trainer
(``invariant``: :func:`skyrl_numerics.invariant.from_checkpoint`), the in-process vLLM engine
(``vllm``: stock; ``vllm-invariant``: ``batch_invariant=True``) and a ``vllm serve`` server with
our worker extension (``vllm-serve``: a :class:`~skyrl_numerics.engine.remote.RemoteGenerator`,
over ``/collective_rpc`` in dev mode, as ``skyrl-numerics serve`` starts it). Each side runs the same
sequences with hooks on its modules (``engine/trace_roles.py``: the canonical names and the
per-family module table) that keep, per token row, a digest of the row and two statistics
(``engine/trace_capture.py``); the engine side records them inside its worker, with vLLM's
schedule (prefill, chunked prefill, decode) of every forward. :func:`compare` then names the
first module where they differ and how the difference grows (``trace_compare.py``).

The trainer sides run one sequence per forward (the whole sequence, as a trainer recomputes a
rollout); the engine runs all sequences as concurrent requests, greedy, ``1 + decode`` tokens
each (``decode`` > 0: the engine's tokens extend the sequences and every side runs them).

Python::

    from skyrl_numerics.doctor.trace import run_trace
    result = run_trace(model_dir, ["hf", "vllm"], per_op=True)
    print(result.table())           # result.comparison.first: the first divergence
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skyrl_numerics.engine.trace_capture import RowLayout, TraceRecorder, decode_seq
from skyrl_numerics.engine.trace_roles import canonical_order, hook_invariant, hook_modules
from skyrl_numerics.errors import InputError

from .trace_compare import ModuleRows, Trace, TraceComparison, compare, format_table, write

__all__ = ["SIDES", "Side", "TraceResult", "trace_side", "run_trace", "compare", "Trace",
           "TraceComparison"]

#: side name -> what it runs
SIDES = {"hf": "HF trainer (transformers, bf16)",
         "hf-mode": "HF trainer under batch_invariant_mode()",
         "invariant": "invariant trainer (skyrl_numerics.invariant)",
         "vllm": "vLLM engine, stock (in-process VLLMGenerator)",
         "vllm-invariant": "vLLM engine, batch-invariant (VLLMGenerator(batch_invariant=True))",
         "vllm-serve": "a vllm serve server (skyrl-numerics serve, dev mode; over HTTP)"}
ENGINE_SIDES = ("vllm", "vllm-invariant", "vllm-serve")


@dataclass
class Side:
    """One side: its ``kind`` (a key of :data:`SIDES`), the name the report shows, and the
    object that runs it (an HF model, an invariant model, a ``VLLMGenerator``; None: built from
    the checkpoint)."""
    kind: str
    name: str | None = None
    model: Any = None

    def __post_init__(self):
        if self.kind not in SIDES:
            raise InputError(f"unknown side {self.kind!r} (known: {', '.join(SIDES)})",
                             field="sides")
        self.name = self.name or self.kind


def parse_sides(spec) -> list[Side]:
    """``"hf,vllm"`` or a list of names / :class:`Side` -> two sides."""
    items = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
    sides = [s if isinstance(s, Side) else Side(s) for s in items if s != ""]
    if len(sides) != 2:
        raise InputError(f"give two sides, got {len(sides)} ({', '.join(s.name for s in sides)})",
                         field="sides")
    if sides[0].name == sides[1].name:
        sides[1].name = f"{sides[1].name} (2)"
    return sides


def _trainer_trace(side: Side, model, sequences: list, per_op: bool, keep: bool) -> Trace:
    """An HF or invariant model's trace: one sequence per forward, hooks on the model
    (``hf-mode``: the forwards under :func:`~skyrl_numerics.kernels.batch_invariant_mode`)."""
    import contextlib

    import torch

    rec = TraceRecorder(keep)
    if side.kind == "invariant":
        unhook, layers = hook_invariant(model, rec.record, per_op), int(model.dims.layers)
    else:
        unhook = hook_modules(model, "hf", model.config, rec.record, per_op)
        layers = int(model.config.num_hidden_layers)
    mode = contextlib.nullcontext()
    if side.kind == "hf-mode":
        from skyrl_numerics.kernels import batch_invariant_mode

        mode = batch_invariant_mode()
    t0 = time.perf_counter()
    try:
        with torch.no_grad(), mode:
            for i, seq in enumerate(sequences):
                rec.layout = RowLayout.sequence(i, len(seq))
                ids = torch.tensor(seq, dtype=torch.long)
                if side.kind == "invariant":
                    model.logits(model.sequence_hidden(ids))
                else:
                    model(input_ids=ids[None], use_cache=False)
    finally:
        unhook()
    forward_s = time.perf_counter() - t0
    got = rec.fetch(list(range(len(sequences))))
    return _trace(side, got, layers, per_op, rec.algo, forward_s, rec.seconds, None, rec.notes)


def _trace(side: Side, got: dict, layers: int, per_op: bool, algo: str, forward_s: float,
           capture_s: float, steps, notes) -> Trace:
    mods = {name: ModuleRows(m["width"], m["dtype"],
                             [None if s is None else decode_seq(s, m["width"]) for s in m["seqs"]])
            for name, m in got.items()}
    order = canonical_order(layers, per_op)
    mods = {n: mods[n] for n in order if n in mods} | {n: m for n, m in mods.items()
                                                       if n not in order}
    return Trace(side.name, side.kind, mods, order, algo, forward_s, capture_s, steps,
                 list(notes))


def _engine_trace(side: Side, gen, sequences: list, per_op: bool, keep: bool,
                  decode: int) -> tuple[Trace, list]:
    from skyrl_numerics.engine.trace_capture import engine_trace, server_trace

    run = server_trace if side.kind == "vllm-serve" else engine_trace
    got = run(gen, sequences, per_op=per_op, keep_tensors=keep, decode=decode)
    tr = _trace(side, got["modules"], got["layers"], per_op, got["algo"], got["forward_s"],
                got["capture_s"], got["steps"], got["notes"])
    return tr, got["sequences"]


def _build(side: Side, model_dir):
    """The object a side runs, built from the checkpoint."""
    if side.kind in ("hf", "hf-mode"):
        from skyrl_numerics.models import load_hf_model

        return load_hf_model(model_dir, dtype="bfloat16")
    if side.kind == "invariant":
        from skyrl_numerics.invariant import from_checkpoint

        return from_checkpoint(model_dir)
    if side.kind == "vllm-serve":
        raise InputError("the vllm-serve side needs a server: --server URL (Side(\"vllm-serve\", "
                         "model=RemoteGenerator(url)) in Python)", field="server")
    from skyrl_numerics.engine.generator import get_generator

    return get_generator(model_dir, batch_invariant=side.kind == "vllm-invariant")


def trace_side(side: Side | str, model_dir, sequences: list, *, per_op: bool = False,
               keep_tensors: bool = False, decode: int = 0) -> tuple[Trace, list]:
    """One side's :class:`Trace` of ``sequences`` (token-id lists) and the sequences it ran
    (an engine with ``decode`` > 0 extends them with its greedy tokens)."""
    side = side if isinstance(side, Side) else Side(side)
    obj = side.model if side.model is not None else _build(side, model_dir)
    if side.kind in ENGINE_SIDES:
        return _engine_trace(side, obj, sequences, per_op, keep_tensors, decode)
    return _trainer_trace(side, obj, sequences, per_op, keep_tensors), sequences


@dataclass
class TraceResult:
    comparison: TraceComparison
    sequences: list
    settings: dict

    @property
    def first(self):
        return self.comparison.first

    def table(self) -> str:
        return format_table(self.comparison)

    def to_dict(self) -> dict:
        return {"settings": self.settings, **self.comparison.to_dict()}

    def write(self, out_dir) -> dict:
        """``trace.json`` + ``trace.png`` in ``out_dir``."""
        return write(self.comparison, Path(out_dir), {"settings": self.settings})


def run_trace(model_dir, sides="hf,vllm", *, per_op: bool = False, n_prompts: int = 4,
              prompt_len: int = 16, decode: int = 0, keep_tensors: bool = False, seed: int = 0,
              sequences: list | None = None, out_dir=None) -> TraceResult:
    """Trace two sides on the same sequences (default: ``n_prompts`` seeded random prompts of
    ``prompt_len`` ids) and compare them; ``out_dir``: also write trace.json / trace.png.
    With ``decode`` > 0 an engine side runs first and its greedy tokens extend the sequences."""
    sides = parse_sides(sides)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    if sequences is None:
        from skyrl_numerics.rollout.prompts import make_prompts

        sequences = make_prompts(n_prompts, prompt_len, int(cfg["vocab_size"]), seed)
    if decode and not any(s.kind in ENGINE_SIDES for s in sides):
        raise InputError("--decode needs an engine side (vllm or vllm-invariant)", field="decode")
    order = sorted(range(2), key=lambda j: sides[j].kind not in ENGINE_SIDES)
    traces: list = [None, None]
    for j in order:
        traces[j], ran = trace_side(sides[j], model_dir, sequences, per_op=per_op,
                                    keep_tensors=keep_tensors,
                                    decode=decode if sides[j].kind in ENGINE_SIDES else 0)
        if sides[j].kind in ENGINE_SIDES and decode:
            sequences, decode = ran, 0     # the other side runs the engine's tokens
    settings = {"model_dir": str(model_dir), "model_type": cfg.get("model_type"),
                "sides": {s.name: SIDES[s.kind] for s in sides}, "per_op": per_op,
                "keep_tensors": keep_tensors, "sequences": len(sequences),
                "tokens": int(sum(len(s) for s in sequences)), "seed": seed,
                "capture_overhead": {t.side: round(t.capture_s / max(t.forward_s - t.capture_s,
                                                                     1e-9), 3)
                                     for t in traces}}
    res = TraceResult(compare(*traces), sequences, settings)
    if out_dir is not None:
        res.write(out_dir)
    return res


def planted(value, index: int | None = None):
    """Move one element of ``value`` (a float tensor, e.g. a layer's weight) one ulp away from
    zero (``torch.nextafter``), in place — for tests and demos of the tracer naming a planted
    change. ``index`` (flat): which element; default the largest in magnitude (whose ulp, and so
    whose effect on the layer's output, is largest). Returns ``(index, old value)`` to put back
    with ``value.view(-1)[index] = old``."""
    import torch

    flat = value.data.view(-1)
    i = int(flat.float().abs().argmax()) if index is None else int(index)
    old = flat[i].clone()
    away = torch.tensor(float("inf") if old >= 0 else float("-inf"), dtype=old.dtype)
    flat[i] = torch.nextafter(old, away)
    return i, old
