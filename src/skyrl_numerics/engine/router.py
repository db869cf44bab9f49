"""Engine replicas behind one ``generate``: :class:`ReplicaRouter`.

Sessions are sticky (a session id — a prompt's group, a multi-turn trajectory — always goes to
the replica that served it first, so that replica's prefix cache serves its later requests, as
SkyRL's ``sticky_least_loaded``); a new session goes to the least-loaded replica (fewest response
tokens assigned so far; ties: lowest index). Each prompt keeps the seed it would get from one
engine (``seed + i`` for prompt ``i`` of the call), so with batch-invariant replicas the merged
rollout is bit for bit the one a single replica returns. Replicas run concurrently (threads: each
replica is a client of a server, or any object with ``generate(prompts, seeds=..., **kw)``).

The merged ``Rollout`` keeps the caller's prompt order; ``meta["replica"]`` names the replica of
every row, ``meta["replicas"]`` holds per replica its URL, rows and tokens/s.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Hashable, Sequence

import numpy as np

from skyrl_numerics.errors import InputError
from skyrl_numerics.rollout import Rollout


class ReplicaRouter:
    def __init__(self, replicas: Sequence):
        if not replicas:
            raise InputError("no replicas", field="replicas")
        self.replicas = list(replicas)
        self.sticky: dict[Hashable, int] = {}
        self.load = [0] * len(self.replicas)
        self._pool = ThreadPoolExecutor(max_workers=len(self.replicas))

    def place(self, session: Hashable, cost: int = 1) -> int:
        """The replica of ``session``: the one it used before, else the least loaded."""
        r = self.sticky.get(session)
        if r is None:
            r = min(range(len(self.replicas)), key=lambda i: (self.load[i], i))
            self.sticky[session] = r
        self.load[r] += cost
        return r

    def generate(self, prompts: Sequence[Sequence[int]], *, seed: int | None = 0,
                 sessions: Sequence[Hashable] | None = None, max_tokens: int = 64, n: int = 1,
                 **kw) -> Rollout:
        """Prompts spread over the replicas (``sessions[i]``: prompt ``i``'s session, default its
        token ids), run concurrently, merged in the caller's order."""
        if not len(prompts):
            raise InputError("no prompts", field="prompts")
        sessions = list(sessions) if sessions is not None else [tuple(int(t) for t in p)
                                                                for p in prompts]
        if len(sessions) != len(prompts):
            raise InputError(f"{len(sessions)} sessions for {len(prompts)} prompts",
                             field="sessions")
        where = [self.place(s, max_tokens * n) for s in sessions]
        parts = {r: [i for i, w in enumerate(where) if w == r] for r in sorted(set(where))}

        def run(r: int):
            idx = parts[r]
            seeds = None if seed is None else [seed + i for i in idx]
            t0 = time.perf_counter()
            ro = self.replicas[r].generate([prompts[i] for i in idx], seeds=seeds,
                                           max_tokens=max_tokens, n=n, **kw)
            return ro, time.perf_counter() - t0

        done = dict(zip(parts, self._pool.map(run, parts)))
        return _merge(prompts, where, parts, done, n, self.replicas)

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def _merge(prompts, where, parts, done, n: int, replicas) -> Rollout:
    """One rollout in the caller's order from the replicas' rollouts."""
    from skyrl_numerics.replay import PackedGates, PackedRoutes, PackedSupport

    first = next(iter(done.values()))[0]
    rows = {}   # (prompt index, sample j) -> (replica, row in its rollout)
    for r, idx in parts.items():
        for k, i in enumerate(idx):
            for j in range(n):
                rows[(i, j)] = (r, k * n + j)
    order = [rows[(i, j)] for i in range(len(prompts)) for j in range(n)]
    p_rows, r_rows, lp_rows, route_seqs, support_sets, top = [], [], [], [], [], []
    digests, gate_seqs = [], []
    for r, b in order:
        ro = done[r][0]
        p_rows.append(ro.prompt(b))
        r_rows.append(ro.response(b))
        lp_rows.append(ro.logprobs(b))
        if first.routes is not None:
            route_seqs.append(ro.routes.seq(b))
        if first.gates is not None:
            gate_seqs.append(ro.gates.seqs(b, b))
        a, e = ro.response_cu[b], ro.response_cu[b + 1]
        if first.support is not None:
            off = ro.support.offsets
            support_sets += [ro.support.token_ids[off[t]:off[t + 1]] for t in range(a, e)]
        if first.topk is not None:
            top.append((ro.topk.ids[a:e], ro.topk.values[a:e]))
        if first.logits_digest is not None:
            digests.append(type(ro.logits_digest)(ro.logits_digest.digests[a:e],
                                                  ro.logits_digest.algo))
    routes = (PackedRoutes.from_sequences(route_seqs, first.routes.num_experts)
              if first.routes is not None else None)
    support = (PackedSupport.from_sets(support_sets, first.support.vocab_size)
               if first.support is not None else None)
    gates = PackedGates.concat(gate_seqs) if first.gates is not None else None
    stats = []
    for r, idx in parts.items():
        ro, dt = done[r]
        stats.append({"replica": r, "url": getattr(replicas[r], "url", str(r)),
                      "rows": len(ro), "tokens": int(ro.num_response_tokens),
                      "tokens_per_s": ro.num_response_tokens / dt if dt > 0 else None})
    meta = {**first.meta, "replica": [r for r, _ in order], "replicas": stats}
    meta.pop("server", None)
    merged = Rollout.from_lists(p_rows, r_rows, lp_rows,
                                group_ids=np.repeat(np.arange(len(prompts)), n), routes=routes,
                                support=support, gates=gates, sampling=first.sampling, engine=first.engine,
                                engine_version=first.engine_version, meta=meta)
    if first.topk is not None:
        from skyrl_numerics.gap.topk import TopkLogprobs

        merged.topk = TopkLogprobs(np.concatenate([i for i, _ in top]),
                                   np.concatenate([v for _, v in top]))
    if first.logits_digest is not None:
        from skyrl_numerics.gap.digest import LogitsDigests

        merged.logits_digest = LogitsDigests.concat(digests)
    return merged
