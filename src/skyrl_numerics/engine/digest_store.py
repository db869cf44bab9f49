"""A digest of every sampled position's full logits row, captured inside a vLLM worker
(:mod:`skyrl_numerics.gap.digest` defines the row and the digest)."""
from __future__ import annotations

import numpy as np

from .sampled_rows import SampledRows, external_id, sampled_positions


class DigestStore(SampledRows):
    """A digest of the full logits row of every sampled position, per request
    (:mod:`skyrl_numerics.gap.digest` defines the row and the digest).

    Installed around the runner's ``sampler.forward`` (the instance patch
    ``"sampler.digest.forward"``, :func:`vllm_patches.wrap_sampler_logits`): that call receives
    ``model.compute_logits``'s rows (model dtype; one per request, ``input_batch`` order; after a
    structured-output bitmask, if any) before the sampler converts them to float32 and processes them. Each row is converted to
    float32 the same way and hashed; nothing else is kept, unless ``keep_rows`` is on (the one-row
    replay of :meth:`VLLMGenerator.logits_row`). Row ``b`` belongs to position
    given by :func:`~.sampled_rows.sampled_positions`.
    """

    def __init__(self, runner, algo: str):
        from skyrl_numerics.hashing import hasher

        hasher(algo)   # an algorithm this worker cannot run fails at start, not mid-step
        super().__init__()                                  # rows: internal req id -> pos -> digest
        self.runner = runner
        self.algo = algo
        self.keep_rows = False
        self.kept: dict[str, dict[int, np.ndarray]] = {}   # the same, float32 rows (keep_rows)

    def capture(self, logits) -> None:
        import torch

        from skyrl_numerics.gap.digest import row_digests

        r = self.runner
        ib = r.input_batch
        n = ib.num_reqs
        if n == 0:          # a dummy sampler run (profiling, warm-up): no request to file it under
            return
        if logits.shape[0] != n:
            raise RuntimeError(f"logits digest: {logits.shape[0]} logits rows for {n} requests "
                               "(speculative decoding is not supported)")
        pos = sampled_positions(r, n)
        rows = logits.detach().to(torch.float32).cpu().contiguous().numpy()
        self.file(ib.req_ids[:n], pos, [d.tobytes() for d in row_digests(rows, self.algo)])
        if self.keep_rows:
            for b, req in enumerate(ib.req_ids[:n]):
                self.kept.setdefault(req, {})[int(pos[b])] = rows[b].copy()

    def pack(self, values: list) -> dict:
        """A run of digests as ``{"digests": bytes}`` (16 per position, in order)."""
        return {"digests": b"".join(values)}

    def fetch_row(self, ext: str, pos: int):
        """The kept float32 row of one position (``keep_rows``) as ``{"row": bytes, "digest":
        bytes}``, or ``None``."""
        for req, got in self.kept.items():
            if external_id(req) == ext and pos in got:
                return {"row": got[pos].astype("<f4").tobytes(), "digest": self.rows[req][pos]}
        return None

    def clear(self) -> None:
        super().clear()
        self.kept.clear()
