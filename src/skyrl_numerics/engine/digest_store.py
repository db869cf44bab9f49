"""A digest of every sampled position's full logits row, captured inside a vLLM worker
(:mod:`skyrl_numerics.gap.digest` defines the row and the digest)."""
from __future__ import annotations

import numpy as np


class DigestStore:
    """A digest of the full logits row of every sampled position, per request
    (:mod:`skyrl_numerics.gap.digest` defines the row and the digest).

    Installed around the runner's ``sampler.forward`` (the instance patch
    ``"sampler.digest.forward"``, :func:`vllm_patches.wrap_sampler_logits`): that call receives
    ``model.compute_logits``'s rows (model dtype; one per request, ``input_batch`` order; after a
    structured-output bitmask, if any) before the sampler converts them to float32 and processes them. Each row is converted to
    float32 the same way and hashed; nothing else is kept, unless ``keep_rows`` is on (the one-row
    replay of :meth:`VLLMGenerator.logits_row`). Row ``b`` belongs to position
    ``positions[query_start_loc[b+1] - 1] + 1`` as in :class:`~.support_store.SupportStore`: a prefix-cache hit
    changes nothing (a sampled position is always computed), rows of a partial prefill chunk land
    on prompt positions, which no fetch asks for.
    """

    def __init__(self, runner, algo: str):
        from skyrl_numerics.hashing import hasher

        hasher(algo)   # an algorithm this worker cannot run fails at start, not mid-step
        self.runner = runner
        self.algo = algo
        self.rows: dict[str, dict[int, bytes]] = {}        # internal req id -> pos -> digest
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
        qsl = np.asarray(r.query_start_loc.np[: n + 1], dtype=np.int64)
        pos = r.positions[: int(qsl[-1])].cpu().numpy().astype(np.int64)[qsl[1:] - 1] + 1
        rows = logits.detach().to(torch.float32).cpu().contiguous().numpy()
        digests = row_digests(rows, self.algo)
        for b, req in enumerate(ib.req_ids[:n]):
            self.rows.setdefault(req, {})[int(pos[b])] = digests[b].tobytes()
            if self.keep_rows:
                self.kept.setdefault(req, {})[int(pos[b])] = rows[b].copy()

    def fetch(self, external_ids: list[str], starts: list[int], lengths: list[int]) -> list:
        """Digests of positions ``start .. start + length - 1`` per external request id, as
        ``{"digests": bytes}`` (16 per position, in order); ``None`` for an unknown request,
        ``("missing", position)`` where a position was not sampled under capture."""
        by_ext = {req.rsplit("-", 1)[0]: req for req in self.rows}
        out = []
        for ext, start, length in zip(external_ids, starts, lengths):
            req = by_ext.get(ext)
            if req is None:
                out.append(None)
                continue
            got = self.rows[req]
            miss = next((q for q in range(start, start + length) if q not in got), None)
            if miss is not None:
                out.append(("missing", miss))
                continue
            out.append({"digests": b"".join(got[q] for q in range(start, start + length))})
        return out

    def fetch_row(self, external_id: str, pos: int):
        """The kept float32 row of one position (``keep_rows``) as ``{"row": bytes, "digest":
        bytes}``, or ``None``."""
        for req, got in self.kept.items():
            if req.rsplit("-", 1)[0] == external_id and pos in got:
                return {"row": got[pos].astype("<f4").tobytes(), "digest": self.rows[req][pos]}
        return None

    def clear(self) -> None:
        self.rows.clear()
        self.kept.clear()
