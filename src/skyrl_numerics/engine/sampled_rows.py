"""What a vLLM worker keeps per request and sampled position (a logits digest, a sampler support),
and how the position of each sampler row is found.

vLLM samples one row per request in ``input_batch`` order. Row ``b``'s token sits at position
``positions[query_start_loc[b+1] - 1] + 1``: one past the last position the step computed for
that request. A prefix-cache hit changes nothing (a sampled position is always computed); rows of
a partial prefill chunk land on prompt positions, which no fetch asks for (vLLM discards those
samples). vLLM's internal request id is ``f"{external}-{8 random chars}"``.
"""
from __future__ import annotations

import numpy as np


def external_id(req: str) -> str:
    """The caller's request id of vLLM's internal one."""
    return req.rsplit("-", 1)[0]


def sampled_positions(runner, n: int) -> np.ndarray:
    """The position of the token each of the step's ``n`` sampler rows draws (module doc)."""
    qsl = np.asarray(runner.query_start_loc.np[: n + 1], dtype=np.int64)
    return runner.positions[: int(qsl[-1])].cpu().numpy().astype(np.int64)[qsl[1:] - 1] + 1


class SampledRows:
    """``rows[internal request id][position] = value`` for every sampled position, and the fetch
    of a run of positions by external id; a subclass packs a run into its wire form."""

    def __init__(self):
        self.rows: dict[str, dict[int, object]] = {}

    def file(self, req_ids, positions, values) -> None:
        """File ``values[b]`` under request ``req_ids[b]``, position ``positions[b]``."""
        for req, pos, value in zip(req_ids, positions, values):
            self.rows.setdefault(req, {})[int(pos)] = value

    def pack(self, values: list) -> dict:
        raise NotImplementedError

    def fetch(self, external_ids: list[str], starts: list[int], lengths: list[int]) -> list:
        """Positions ``start .. start + length - 1`` per external request id, packed
        (:meth:`pack`); ``None`` for an unknown request, ``("missing", position)`` where a
        position was not sampled under capture."""
        by_ext = {external_id(req): req for req in self.rows}
        out = []
        for ext, start, length in zip(external_ids, starts, lengths):
            req = by_ext.get(ext)
            if req is None:
                out.append(None)
                continue
            got = self.rows[req]
            miss = next((q for q in range(start, start + length) if q not in got), None)
            out.append(("missing", miss) if miss is not None
                       else self.pack([got[q] for q in range(start, start + length)]))
        return out

    def clear(self) -> None:
        self.rows.clear()
