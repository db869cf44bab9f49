"""RouteTrace: a multi-turn trajectory's routes, built from per-turn deltas.

An agent loop re-sends the whole history every turn; shipping the full prefix's routes each turn costs
``O(N^2)`` bytes over a trajectory of ``N`` tokens. With turn-only deltas (vLLM's
``routed_experts_prompt_start`` or a capture that records only the positions it computed) each position
is shipped once: the trace keeps the deltas as they arrive (``O(N)`` bytes) and materializes one packed
sequence at the end.

Continuity: under the route convention of :mod:`.routes` (rows cover every position the engine ran
through the model, i.e. all but the final sampled token of a turn), turn ``t``'s delta starts exactly where
the trace ends: the last sampled token of turn ``t-1`` is the first position the engine runs in turn ``t``.
A delta that starts later leaves positions without routes (error); one that starts earlier overlaps
positions already recorded: an error unless ``allow_overlap=True``, in which case the recorded rows win
(the KV cache that later tokens attended to was computed with them) and the overlap is dropped.

Gate weights (``gate_dtype`` set): each delta carries the engine's combine weights ``[n_t, L, k]``
beside its ids (:mod:`.gates`), checked, trimmed and concatenated the same way; :meth:`to_gates`
materializes them as one :class:`PackedGates` sequence with the rows of :meth:`to_routes`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from skyrl_numerics.errors import InputError

from .gates import GATE_DTYPES, PackedGates, encode_gates
from .routes import PackedRoutes, id_dtype


@dataclass
class TurnDelta:
    """One turn's rows: expert ids ``[n, L, k]`` and, in a trace with gates, their stored weights."""
    ids: np.ndarray
    gates: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return self.ids.nbytes + (0 if self.gates is None else self.gates.nbytes)


class RouteTrace:
    """Accumulates per-turn route deltas ``[n_t, L, k]`` for one trajectory."""

    def __init__(self, num_layers: int, k: int, num_experts: int, *, gate_dtype: str | None = None):
        self.num_layers, self.k, self.num_experts = int(num_layers), int(k), int(num_experts)
        self._dtype = id_dtype(num_experts)
        if gate_dtype is not None and gate_dtype not in GATE_DTYPES:
            raise InputError(f"unknown gate dtype {gate_dtype!r}, expected one of {sorted(GATE_DTYPES)}",
                             field="gate_dtype")
        self.gate_dtype = gate_dtype
        self._chunks: list[TurnDelta] = []
        self._turn_starts: list[int] = []
        self.num_tokens = 0

    @property
    def num_turns(self) -> int:
        return len(self._chunks)

    @property
    def nbytes(self) -> int:
        """Bytes held: ``num_tokens * L * k * (id itemsize + gate itemsize)`` (each position once)."""
        return sum(c.nbytes for c in self._chunks)

    @property
    def turn_starts(self) -> list[int]:
        return list(self._turn_starts)

    def add(self, delta: np.ndarray, start: int | None = None, *, allow_overlap: bool = False,
            gates=None) -> "RouteTrace":
        """Append routes for positions ``[start, start + len(delta))``; ``start`` defaults to the trace end.
        ``gates``: the delta's combine weights ``[n, L, k]`` (floats), required exactly when the trace
        was made with ``gate_dtype``."""
        turn = self.num_turns
        delta = np.asarray(delta)
        if (gates is None) != (self.gate_dtype is None):
            raise InputError(f"turn {turn}: " + ("gate weights given to a trace without gate_dtype"
                             if gates is not None else "this trace carries gate weights; pass gates="),
                             field="gates", index=turn)
        if gates is not None:
            gates = encode_gates(gates, self.gate_dtype)
            if gates.shape != delta.shape:
                raise InputError(f"turn {turn}: gates of shape {gates.shape} for ids of shape {delta.shape}",
                                 field="gates", index=turn)
        if delta.ndim != 3:
            raise InputError(f"turn {turn}: expected [tokens, layers, k], got shape {delta.shape}", field="delta",
                             index=turn)
        if delta.shape[1] != self.num_layers:
            raise InputError(f"turn {turn}: {delta.shape[1]} layers, trace has {self.num_layers}", field="layers",
                             index=turn)
        if delta.shape[2] != self.k:
            raise InputError(f"turn {turn}: k={delta.shape[2]}, trace has k={self.k}", field="k", index=turn)
        if delta.dtype.kind not in "ui":
            raise InputError(f"turn {turn}: expert ids must be integers, got {delta.dtype}", field="delta",
                             index=turn)
        start = self.num_tokens if start is None else int(start)
        if start > self.num_tokens:
            raise InputError(f"turn {turn} starts at position {start} but the trace covers {self.num_tokens} "
                             f"positions: routes for {start - self.num_tokens} tokens are missing",
                             field="start", index=turn)
        if start < 0:
            raise InputError(f"turn {turn}: negative start {start}", field="start", index=turn)
        if start < self.num_tokens:
            if not allow_overlap:
                raise InputError(f"turn {turn} starts at position {start} but the trace already covers "
                                 f"{self.num_tokens} positions ({self.num_tokens - start} overlap)",
                                 field="start", index=turn)
            delta = delta[self.num_tokens - start:]
            gates = None if gates is None else gates[self.num_tokens - start:]
        if delta.size:
            if delta.dtype.kind == "i" and int(delta.min()) < 0:
                raise InputError(f"turn {turn}: negative expert id {int(delta.min())}", field="delta", index=turn)
            if int(delta.max()) >= self.num_experts:
                raise InputError(f"turn {turn}: expert id {int(delta.max())} >= num_experts {self.num_experts}",
                                 field="delta", index=turn)
        self._chunks.append(TurnDelta(np.ascontiguousarray(delta, dtype=self._dtype),
                                      None if gates is None else np.ascontiguousarray(gates)))
        self._turn_starts.append(self.num_tokens)
        self.num_tokens += delta.shape[0]
        return self

    def check_length(self, total_tokens: int) -> None:
        """Check the trace covers a trajectory of ``total_tokens`` tokens: ``total_tokens - 1`` rows (the final
        sampled token is never run by the engine) or ``total_tokens`` rows (a capture that padded it)."""
        if self.num_tokens not in (total_tokens - 1, total_tokens):
            raise InputError(f"trace covers {self.num_tokens} positions, trajectory has {total_tokens} tokens "
                             f"(expected {total_tokens - 1} or {total_tokens})", field="num_tokens")

    def to_routes(self) -> PackedRoutes:
        """One packed sequence with all positions (one copy into the final buffer)."""
        out = PackedRoutes.empty([self.num_tokens], self.num_layers, self.k, self.num_experts)
        row = 0
        for c in self._chunks:
            out.values[row:row + c.ids.shape[0]] = c.ids
            row += c.ids.shape[0]
        return out

    def to_gates(self) -> PackedGates:
        """The combine weights of :meth:`to_routes`' rows, one packed sequence (``gate_dtype`` traces)."""
        if self.gate_dtype is None:
            raise InputError("this trace carries no gate weights (make it with gate_dtype=)", field="gates")
        shape = (0, self.num_layers, self.k)
        vals = (np.concatenate([c.gates for c in self._chunks]) if self._chunks
                else np.zeros(shape, GATE_DTYPES[self.gate_dtype]))
        return PackedGates(vals, np.array([0, self.num_tokens], dtype=np.int32), self.gate_dtype)
