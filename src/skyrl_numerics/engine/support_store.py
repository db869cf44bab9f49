"""The sampler's support per request and sampled position, captured inside a vLLM worker
(top-p / top-k support replay; :mod:`skyrl_numerics.replay.support` consumes it)."""
from __future__ import annotations

import numpy as np


class SupportStore:
    """The support the sampler kept, per request and sampled position (top-p / top-k capture).

    Installed around the runner's ``sampler.topk_topp_sampler.forward`` (an instance attribute
    vLLM picks per platform; the patch ``"sampler.forward"``, :func:`vllm_patches.wrap_sampler`):
    that call receives the temperature-scaled logits of every request
    in the batch (row ``b`` = ``input_batch`` order) with its ``k`` / ``p`` and returns the
    sampled ids and, in ``processed_logprobs`` mode, the log-softmax of the truncated logits:
    ``-inf`` exactly outside the support the token was drawn from. The support is read from those
    (other modes: from ``apply_top_k_top_p`` on a copy of the logits), as sorted int32 ids.
    Row ``b``'s token is the one at position ``positions[query_start_loc[b+1] - 1] + 1``; rows of
    a partial prefill chunk land on prompt positions, which no fetch asks for (vLLM discards
    those samples).
    """

    def __init__(self, runner):
        self.runner = runner
        self.rows: dict[str, dict[int, np.ndarray]] = {}   # internal req id -> pos -> ids

    def capture(self, logits, k, p, processed) -> None:
        import torch

        r = self.runner
        ib = r.input_batch
        n = ib.num_reqs
        if processed is None:  # not a processed_* logprobs mode: logits is an untouched copy
            from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

            processed = apply_top_k_top_p(logits, k, p)
        if processed.shape[0] != n:
            raise RuntimeError(f"support capture: {processed.shape[0]} sampled rows for {n} "
                               "requests (speculative decoding is not supported)")
        qsl = np.asarray(r.query_start_loc.np[: n + 1], dtype=np.int64)
        pos = r.positions[: int(qsl[-1])].cpu().numpy().astype(np.int64)[qsl[1:] - 1] + 1
        nz = torch.isfinite(processed).nonzero().cpu().numpy()
        counts = np.bincount(nz[:, 0], minlength=n)
        ids = nz[:, 1].astype(np.int32)
        for b, (req, chunk) in enumerate(zip(ib.req_ids[:n], np.split(ids, np.cumsum(counts)[:-1]))):
            self.rows.setdefault(req, {})[int(pos[b])] = chunk

    def fetch(self, external_ids: list[str], starts: list[int], lengths: list[int]) -> list:
        """Supports of positions ``start .. start + length - 1`` per external request id, as
        ``{ids, offsets}`` bytes (int32 ids, int64 CSR offsets); ``None`` for an unknown request,
        ``("missing", position)`` where a position was not sampled under capture."""
        by_ext = {req.rsplit("-", 1)[0]: req for req in self.rows}
        out = []
        for ext, start, length in zip(external_ids, starts, lengths):
            req = by_ext.get(ext)
            if req is None:
                out.append(None)
                continue
            got = self.rows[req]
            rows = []
            for q in range(start, start + length):
                if q not in got:
                    rows = ("missing", q)
                    break
                rows.append(got[q])
            if isinstance(rows, tuple):
                out.append(rows)
                continue
            off = np.zeros(len(rows) + 1, dtype=np.int64)
            np.cumsum([len(x) for x in rows], out=off[1:])
            ids = np.concatenate(rows) if rows else np.zeros(0, np.int32)
            out.append({"ids": ids.astype(np.int32).tobytes(), "offsets": off.tobytes()})
        return out

    def take(self, req: str, pos: int):
        """The support of position ``pos`` of one internal request id (``None`` if not sampled
        under capture); drops that row and every earlier one of the request."""
        got = self.rows.get(req)
        if not got:
            return None
        row = got.pop(pos, None)
        for q in [q for q in got if q < pos]:
            del got[q]
        return row

    def drop(self, req: str) -> None:
        self.rows.pop(req, None)

    def clear(self) -> None:
        self.rows.clear()
