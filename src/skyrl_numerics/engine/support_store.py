"""The sampler's support per request and sampled position, captured inside a vLLM worker
(top-p / top-k support replay; :mod:`skyrl_numerics.replay.support` consumes it)."""
from __future__ import annotations

import numpy as np

from .sampled_rows import SampledRows, sampled_positions


class SupportStore(SampledRows):
    """The support the sampler kept, per request and sampled position (top-p / top-k capture).

    Installed around the runner's ``sampler.topk_topp_sampler.forward`` (an instance attribute
    vLLM picks per platform; the patch ``"sampler.forward"``, :func:`vllm_patches.wrap_sampler`):
    that call receives the temperature-scaled logits of every request
    in the batch (row ``b`` = ``input_batch`` order) with its ``k`` / ``p`` and returns the
    sampled ids and, in ``processed_logprobs`` mode, the log-softmax of the truncated logits:
    ``-inf`` exactly outside the support the token was drawn from. The support is read from those
    (other modes: from ``apply_top_k_top_p`` on a copy of the logits), as sorted int32 ids.
    Row ``b``'s position: :func:`~.sampled_rows.sampled_positions`.
    """

    def __init__(self, runner):
        super().__init__()                                  # rows: internal req id -> pos -> ids
        self.runner = runner

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
        nz = torch.isfinite(processed).nonzero().cpu().numpy()
        counts = np.bincount(nz[:, 0], minlength=n)
        ids = nz[:, 1].astype(np.int32)
        self.file(ib.req_ids[:n], sampled_positions(r, n), np.split(ids, np.cumsum(counts)[:-1]))

    def pack(self, values: list) -> dict:
        """A run of supports as ``{ids, offsets}`` bytes (int32 ids, int64 CSR offsets)."""
        off = np.zeros(len(values) + 1, dtype=np.int64)
        np.cumsum([len(x) for x in values], out=off[1:])
        ids = np.concatenate(values) if values else np.zeros(0, np.int32)
        return {"ids": ids.astype(np.int32).tobytes(), "offsets": off.tobytes()}

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
