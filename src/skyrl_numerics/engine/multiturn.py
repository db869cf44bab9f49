"""Multi-turn agent trajectories through a vLLM engine: :func:`generate_multiturn`.

A trajectory is prompt → model turn → environment observation → model turn → … Every turn is one
engine request over the whole history (the engine's prefix cache reuses the KV of what came
before); the model's tokens are sampled, the observation's are the environment's. The result is
one :class:`~skyrl_numerics.rollout.Rollout` row per trajectory with ``loss_mask`` (True on model
tokens) and ``turns`` (:mod:`skyrl_numerics.rollout.turns`): an observation belongs to the turn
whose model segment follows it, logprobs are NaN on observation tokens.

Environment protocol (:class:`Env`; one environment per trajectory, from a factory — a class or
any zero-argument callable, picklable when the loop runs on Ray)::

    env.reset(prompt_ids)                 -> None
    env.step(model_token_ids)             -> EnvStep(observation ids, reward, done)

The environment steps after every model turn, the last one included; the trajectory's reward is the
sum of its step rewards (``meta["env_reward"]``). A trajectory ends when the environment says
``done``, after ``max_turns`` model turns (the last turn's observation is not appended: observation
tokens after the last model segment are no turn), or when
the next turn would not fit (``len(history) + max_tokens > max_model_len``; its pending observation
is dropped too). Observation ids outside ``[0, vocab)`` are an ``InputError`` naming the
trajectory and turn.

Routes (R3) as turn deltas: turn ``t`` asks the engine only for the routes of positions from
``trace.num_tokens`` on (vLLM's ``routed_experts_prompt_start`` over HTTP, the capture's
``starts`` in process): the last sampled token of turn ``t-1`` and everything after it; what the
prefix cache served is not sent again. A :class:`~skyrl_numerics.replay.RouteTrace` per
trajectory assembles them; ``meta["route_bytes"]`` holds the bytes shipped as deltas and what a
full-prefix resend of every turn would have shipped. ``route_deltas=False`` fetches the full
prefix each turn (the reference the deltas are tested against) and keeps the rows a previous turn
already recorded (they produced the KV later tokens attended to).

DSA indexer choices (an engine with ``capture_index=True``): turn deltas from the same starts,
assembled by a second :class:`~skyrl_numerics.replay.RouteTrace` (key positions for expert ids)
into ``ro.index`` (:class:`~skyrl_numerics.replay.PackedIndex`); ``meta["index_bytes"]`` holds the
bytes shipped and a full-prefix resend's, as for routes.

Supports (top-p / top-k replay): a model token's row is the set the sampler kept in its turn; an
observation token's row is the token alone (never trained on, so never read by the loss).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol, Sequence

import numpy as np

from skyrl_numerics.errors import InputError
from skyrl_numerics.gap.digest import DIGEST_BYTES, LogitsDigests, default_algo
from skyrl_numerics.gap.topk import TopkLogprobs
from skyrl_numerics.replay import PackedGates, PackedIndex, PackedRoutes, PackedSupport, RouteTrace
from skyrl_numerics.replay.gates import GATE_DTYPES
from skyrl_numerics.rollout import Rollout


@dataclass(frozen=True)
class EnvStep:
    observation: list        # token ids fed to the model before its next turn
    reward: float = 0.0
    done: bool = False


class Env(Protocol):
    def reset(self, prompt: Sequence[int]) -> None: ...

    def step(self, model_tokens: Sequence[int]) -> EnvStep: ...


@dataclass
class KeyValueEnv:
    """A toy tool: a key-value store the model queries, so the loop runs without a network.

    At ``reset`` the store maps each key ``0 .. n_keys-1`` to ``value_len`` token ids drawn from the
    prompt's hash (the same prompt, the same store). A model turn is a query: its last token is the
    key. The observation is ``[open_token, *value, close_token]`` for a known key and
    ``[open_token, miss_token, close_token]`` otherwise. Reward per turn: the share of the turn's
    tokens that are valid keys (well-formed tool calls; 12.5 % for a random policy over 512 ids
    with 64 keys), so a policy that learns to call the tool well gains. Done when the model emits
    ``stop_token`` as its last token.
    """
    n_keys: int = 64
    value_len: int = 3
    vocab_size: int = 512
    open_token: int = 500
    close_token: int = 501
    miss_token: int = 502
    stop_token: int = 503

    def reset(self, prompt: Sequence[int]) -> None:
        h = hashlib.blake2b(np.asarray(prompt, np.int64).tobytes(), digest_size=8).digest()
        rng = np.random.default_rng(int.from_bytes(h, "little"))
        self.table = rng.integers(0, self.n_keys, size=(self.n_keys, self.value_len))

    def step(self, model_tokens: Sequence[int]) -> EnvStep:
        toks = np.asarray(model_tokens, np.int64)
        reward = float((toks < self.n_keys).mean()) if toks.size else 0.0
        key = int(toks[-1]) if toks.size else -1
        done = key == self.stop_token
        value = self.table[key].tolist() if 0 <= key < self.n_keys else [self.miss_token]
        return EnvStep([self.open_token, *value, self.close_token], reward, done)


def _num_experts(gen) -> int | None:
    info = getattr(gen, "route_info", None)
    if info:
        return int(info["num_experts"])
    layout = gen.moe_layout() if hasattr(gen, "moe_layout") else None
    return None if layout is None else int(layout[0])


@dataclass(frozen=True)
class MultiTurnOptions:
    """The options of :func:`generate_multiturn` (its keywords)."""
    max_turns: int = 4
    max_tokens: int = 16                  # per model turn
    n: int = 1                            # trajectories per prompt
    seed: int = 0                         # trajectory i's turn t: seed + 1000 t + i
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    capture_support: bool | str = False
    routes: bool | None = None            # None: when the engine captures them; True: required
    route_deltas: bool = True             # False: the full prefix every turn (the reference)
    ignore_eos: bool = True
    topk_logprobs: int = 0
    logits_digest: bool = False
    gate_weights: bool | str = False      # the engine's combine weights too (PackedGates dtype)

    @property
    def gate_dtype(self) -> str | None:
        return None if not self.gate_weights else ("float16" if self.gate_weights is True
                                                   else str(self.gate_weights))

    def sampling(self) -> dict:
        """The rollout's ``sampling`` record."""
        return dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                    seed=self.seed, n=self.n, max_tokens=self.max_tokens,
                    max_turns=int(self.max_turns), logprobs_mode="processed_logprobs")


@dataclass
class Trajectory:
    """One trajectory while it is sampled; becomes one Rollout row. The response holds the
    observation and model tokens of every turn, one entry per token in each per-token list."""
    index: int                  # trajectory i (its seeds, errors name it)
    group: int                  # the prompt it started from
    prompt: list                # that prompt, as given
    env: Env
    history: list[int]          # prompt + response + pending observation: the next request
    tokens: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)    # None at observation tokens
    mask: list[bool] = field(default_factory=list)  # True: model token
    turns: list[int] = field(default_factory=list)  # each token's turn
    support: list = field(default_factory=list)     # the sampled support (observation: itself)
    topk: list = field(default_factory=list)        # (ids [K], values [K]) per token
    digests: list = field(default_factory=list)     # logits digest [16] per token
    pending: list[int] = field(default_factory=list)  # observation before the next model turn
    reward: float = 0.0                             # sum of the environment's step rewards
    trace: RouteTrace | None = None                 # routes, assembled from turn deltas
    index_trace: RouteTrace | None = None           # DSA indexer choices, the same way
    done: bool = False

    @classmethod
    def start(cls, index: int, group: int, prompt, env: Callable[[], Env]) -> "Trajectory":
        e = env()
        e.reset([int(t) for t in prompt])
        return cls(index, group, list(prompt), e, [int(t) for t in prompt])

    def _token(self, tok: int, logprob, model: bool, turn: int, support, topk, digest) -> None:
        self.tokens.append(tok)
        self.logprobs.append(logprob)
        self.mask.append(model)
        self.turns.append(turn)
        if support is not None:
            self.support.append(support)
        if topk is not None:
            self.topk.append(topk)
        if digest is not None:
            self.digests.append(digest)

    def add_observation(self, t: int, opts: MultiTurnOptions, digest_bytes: int) -> None:
        """The pending observation, as turn ``t``'s first tokens (no logprob, top-K NaN,
        digest zeros, support the token alone)."""
        K = opts.topk_logprobs
        for o in self.pending:
            self._token(o, None, False, t, np.asarray([o], np.int64),
                        (np.zeros(K, np.int32), np.full(K, np.nan, np.float32)) if K else None,
                        np.zeros(digest_bytes, np.uint8) if opts.logits_digest else None)
        self.pending = []

    def add_model_turn(self, ro: Rollout, k: int, t: int, opts: MultiTurnOptions) -> None:
        """Row ``k`` of turn ``t``'s rollout ``ro``: the model's tokens."""
        a = int(ro.response_cu[k])
        for j, x in enumerate(int(x) for x in ro.response(k)):
            self._token(x, float(ro.rollout_logprobs[a + j]), True, t,
                        None if ro.support is None else np.asarray(ro.support.row(a + j), np.int64),
                        (ro.topk.ids[a + j], ro.topk.values[a + j]) if opts.topk_logprobs else None,
                        ro.logits_digest.digests[a + j] if opts.logits_digest else None)

    def add_routes(self, start: int, rows, n_new: int, num_experts: int,
                   allow_overlap: bool, gates=None, gate_dtype: str | None = None) -> tuple[int, int]:
        """Turn routes ``rows`` (and combine weights ``gates``, stored as ``gate_dtype``) from
        position ``start`` on (before the turn's ``n_new`` tokens join the history);
        ``(bytes shipped, bytes of a full-prefix resend)``, weights included."""
        rows = np.asarray(rows)
        if self.trace is None:
            self.trace = RouteTrace(rows.shape[1], rows.shape[2], num_experts, gate_dtype=gate_dtype)
        per_row = rows.shape[1] * rows.shape[2] * (rows.itemsize + (
            GATE_DTYPES[gate_dtype].itemsize if gate_dtype else 0))
        full = (len(self.history) + n_new - 1) * per_row
        self.trace.add(rows, start, allow_overlap=allow_overlap, gates=gates)
        return rows.shape[0] * per_row, full

    def add_index(self, start: int, rows, n_new: int, info: dict,
                  allow_overlap: bool) -> tuple[int, int]:
        """Turn indexer rows (key positions ``[n, L, topk]``) from position ``start`` on;
        ``(bytes shipped, bytes of a full-prefix resend)``."""
        rows = np.asarray(rows)
        if self.index_trace is None:
            self.index_trace = RouteTrace(info["layers"], info["topk"], info["bound"])
        per_row = rows.shape[1] * rows.shape[2] * rows.itemsize
        self.index_trace.add(rows, start, allow_overlap=allow_overlap)
        return rows.shape[0] * per_row, (len(self.history) + n_new - 1) * per_row

    def trace_end(self) -> int:
        """Positions recorded so far (the next turn's delta start)."""
        tr = self.trace if self.trace is not None else self.index_trace
        return 0 if tr is None else tr.num_tokens

    def step(self, toks: list[int], vocab, t: int, last: bool) -> None:
        """The environment's step after the model turn ``toks`` (the last turn too: its
        reward); the trajectory ends on ``done``, an empty observation or the last turn, else
        the observation waits for the next turn."""
        self.history += toks
        st = self.env.step(toks)
        self.reward += float(st.reward)
        obs = _checked_observation(st.observation, vocab, self.index, t)
        if st.done or not obs or last:
            self.done = True
            return
        self.pending = obs
        self.history += obs


@dataclass
class TurnLog:
    """What the turns of one call add up to (the rollout's meta)."""
    generate_s: float = 0.0
    cached: list = field(default_factory=list)   # per turn: prefix-cache hits per request
    delta_bytes: int = 0
    full_bytes: int = 0
    index_bytes: list = field(default_factory=lambda: [0, 0])   # shipped, full-prefix resend
    digest_algo: str | None = None

    def record(self, ro: Rollout, n_requests: int, logits_digest: bool):
        """One turn's rollout; returns its route deltas (``None``: the engine sent none)."""
        if logits_digest:
            self.digest_algo = ro.logits_digest.algo
        self.generate_s += float(ro.meta.get("generate_s") or 0.0)
        self.cached.append([int(c) for c in ro.meta.get("num_cached_tokens", [0] * n_requests)])
        deltas, gates = ro.meta.pop("route_deltas", None), ro.meta.pop("gate_deltas", None)
        if deltas is not None and gates is not None:   # (start, ids, combine weights) per row
            return [(a, ids, g) for (a, ids), (_, g) in zip(deltas, gates)]
        return deltas

    def meta(self, route_deltas: bool) -> dict:
        return dict(generate_s=self.generate_s, num_cached_tokens_per_turn=self.cached,
                    route_bytes={"delta": int(self.delta_bytes), "full_resend": int(self.full_bytes)},
                    route_deltas=bool(route_deltas),
                    index_bytes={"delta": int(self.index_bytes[0]),
                                 "full_resend": int(self.index_bytes[1])})


def generate_multiturn(gen, prompts: Sequence[Sequence[int]], env: Callable[[], Env],
                       options: MultiTurnOptions | None = None, **kw) -> Rollout:
    """``n`` trajectories per prompt (rows grouped by prompt, as ``generate``) through ``gen``
    (a :class:`~.generator.VLLMGenerator` or :class:`~.remote.RemoteGenerator`); see the module
    doc. Keywords (or ``options``, which they override): :class:`MultiTurnOptions` —
    ``max_turns=4, max_tokens=16, n=1, seed=0, temperature=1.0, top_p=1.0, top_k=0,
    capture_support=False, routes=None, route_deltas=True, ignore_eos=True, topk_logprobs=0,
    logits_digest=False, gate_weights=False``. ``routes``: ``None`` takes them when the engine captures them,
    ``True`` requires them. Trajectory ``i``'s turn ``t`` samples with seed ``seed + 1000 t + i``.
    ``topk_logprobs``: the engine's top-K per model token in ``ro.topk`` (observation rows: ids
    0, values NaN; ``TopkCheck(mask=loss_mask)`` skips them). ``logits_digest``: the engine's
    full-row digest per model token in ``ro.logits_digest`` (observation rows: zeros;
    ``DigestCheck(mask=)``). ``gate_weights``: the engine's combine weights beside the routes, as
    turn deltas too (``ro.gates``, :class:`~skyrl_numerics.replay.PackedGates`)."""
    opts = replace(options or MultiTurnOptions(), **kw)
    num_experts = _checked(gen, env, opts)
    index_info = getattr(gen, "index_info", None)
    trajs = [Trajectory.start(i, p, prompts[p], env)
             for i, p in enumerate(p for p in range(len(prompts)) for _ in range(opts.n))]
    log = TurnLog()
    max_len = getattr(gen, "max_model_len", None) or (1 << 62)
    for t in range(int(opts.max_turns)):
        for tr in trajs:   # the next turn must fit
            tr.done = tr.done or len(tr.history) + opts.max_tokens > max_len
        active = [tr for tr in trajs if not tr.done]
        if not active:
            break
        ro = _sample_turn(gen, active, t, opts, num_experts is not None or bool(index_info))
        index_deltas = ro.meta.pop("index_deltas", None)
        deltas = log.record(ro, len(active), opts.logits_digest)
        if num_experts is not None and deltas is None:
            if opts.routes or t > 0:
                raise InputError(f"turn {t}: the engine sent no routes (a server needs "
                                 "--enable-return-routed-experts)", field="routes")
            num_experts = None       # routes=None (auto): this engine captures none
        for k, tr in enumerate(active):
            if index_deltas is not None and ro.response(k).size:
                start, rows = index_deltas[k]
                got = tr.add_index(start, rows, int(ro.response(k).size), index_info,
                                   allow_overlap=not opts.route_deltas)
                log.index_bytes = [a + b for a, b in zip(log.index_bytes, got)]
            _take_turn(tr, ro, k, t, opts, None if deltas is None else deltas[k], num_experts,
                       log, getattr(gen, "vocab_size", None))
    out = _assemble(gen, trajs, num_experts, opts, log)
    if index_info and all(tr.index_trace is not None for tr in trajs):
        for tr in trajs:
            tr.index_trace.check_length(len(tr.prompt) + len(tr.tokens))
        out.index = PackedIndex.from_sequences([tr.index_trace.to_routes().values for tr in trajs],
                                               index_info["topk"])
        out.validate()
    return out


def _checked(gen, env, opts: MultiTurnOptions) -> int | None:
    """The call's checks; the engine's expert count when routes are fetched (else ``None``)."""
    if int(opts.max_turns) < 1:
        raise InputError(f"max_turns must be >= 1, got {opts.max_turns}", field="max_turns")
    if not callable(env):
        raise InputError("env must be a factory (a class or zero-argument callable) giving one "
                         "environment per trajectory", field="env")
    num_experts = _num_experts(gen) if opts.routes is not False else None
    if opts.routes and num_experts is None:
        raise InputError("routes asked for but the engine captures none (an MoE model with route "
                         "capture on)", field="routes")
    return num_experts


def _sample_turn(gen, active: list[Trajectory], t: int, opts: MultiTurnOptions,
                 deltas: bool) -> Rollout:
    """Turn ``t``: one request per active trajectory over its whole history; routes (and
    indexer choices) from each trace's end on (``route_deltas=False``: from 0)."""
    starts = None
    if deltas:
        starts = [tr.trace_end() if opts.route_deltas else 0 for tr in active]
    return gen.generate([tr.history for tr in active], n=1,
                        seeds=[opts.seed + 1000 * t + tr.index for tr in active],
                        max_tokens=opts.max_tokens, temperature=opts.temperature,
                        top_p=opts.top_p, top_k=opts.top_k, capture_support=opts.capture_support,
                        ignore_eos=opts.ignore_eos, route_starts=starts,
                        **({"topk_logprobs": opts.topk_logprobs} if opts.topk_logprobs else {}),
                        **({"logits_digest": True} if opts.logits_digest else {}),
                        **({"gate_weights": opts.gate_weights} if opts.gate_weights else {}))


def _take_turn(tr: Trajectory, ro: Rollout, k: int, t: int, opts: MultiTurnOptions, delta,
               num_experts: int | None, log: TurnLog, vocab) -> None:
    """Row ``k`` of turn ``t``'s rollout into ``tr``: its pending observation, the model's
    tokens, their route delta, then the environment's step."""
    toks = [int(x) for x in ro.response(k)]
    if not toks:        # nothing sampled: the trajectory ends, its pending observation with it
        tr.done = True
        return
    digest_bytes = ro.logits_digest.digests.shape[1] if opts.logits_digest else 0
    tr.add_observation(t, opts, digest_bytes)
    tr.add_model_turn(ro, k, t, opts)
    if delta is not None:
        start, rows, gates = (*delta, None) if len(delta) == 2 else delta
        shipped, full = tr.add_routes(start, rows, len(toks), num_experts,
                                      allow_overlap=not opts.route_deltas, gates=gates,
                                      gate_dtype=opts.gate_dtype)
        log.delta_bytes += shipped
        log.full_bytes += full
    tr.step(toks, vocab, t, last=t + 1 == opts.max_turns)


def _checked_observation(obs, vocab, i: int, t: int) -> list[int]:
    arr = np.asarray(obs)
    if arr.size == 0:
        return []
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InputError(f"trajectory {i}, turn {t}: the environment's observation must be a 1-D "
                         f"list of token ids, got {arr.dtype} of shape {arr.shape}",
                         field="observation", row=i)
    bad = (arr < 0) | (arr >= (vocab or (1 << 62)))
    if bad.any():
        j = int(np.argmax(bad))
        raise InputError(f"trajectory {i}, turn {t}: observation token {int(arr[j])} outside "
                         f"[0, {vocab})", field="observation", row=i, index=j)
    return [int(x) for x in arr]


def _assemble(gen, trajs: list[Trajectory], num_experts: int | None, opts: MultiTurnOptions,
              log: TurnLog) -> Rollout:
    """One Rollout row per trajectory: loss mask and turns, routes from the traces, supports,
    top-K and digests when asked for."""
    routes = None
    if num_experts is not None and all(tr.trace is not None for tr in trajs):
        for tr in trajs:
            tr.trace.check_length(len(tr.prompt) + len(tr.tokens))
        routes = PackedRoutes.from_sequences([tr.trace.to_routes().values for tr in trajs],
                                             num_experts)
    gates = None
    if routes is not None and opts.gate_dtype:
        gates = PackedGates.concat([tr.trace.to_gates() for tr in trajs])
    support = None
    if opts.capture_support:
        support = PackedSupport.from_sets([row for tr in trajs for row in tr.support],
                                          vocab_size=getattr(gen, "vocab_size", None))
    info = getattr(gen, "info", None)
    meta = log.meta(opts.route_deltas)
    n_model = sum(sum(tr.mask) for tr in trajs)
    meta.update(model_dir=getattr(gen, "model_dir", None),
                env_reward=[float(tr.reward) for tr in trajs],
                tokens_per_s=n_model / meta["generate_s"] if meta["generate_s"] > 0 else None)
    out = Rollout.from_lists([tr.prompt for tr in trajs], [tr.tokens for tr in trajs],
                             [tr.logprobs for tr in trajs], loss_mask=[tr.mask for tr in trajs],
                             turns=[tr.turns for tr in trajs],
                             group_ids=np.asarray([tr.group for tr in trajs]), routes=routes,
                             support=support, gates=gates, sampling=opts.sampling(),
                             engine=getattr(info, "name", "vllm"),
                             engine_version=getattr(info, "version", "unknown"), meta=meta)
    if opts.topk_logprobs:
        rows, k = [r for tr in trajs for r in tr.topk], int(opts.topk_logprobs)
        out.topk = TopkLogprobs(
            np.stack([r[0] for r in rows]) if rows else np.zeros((0, k), np.int32),
            np.stack([r[1] for r in rows]) if rows else np.zeros((0, k), np.float32))
    if opts.logits_digest:
        rows = [d for tr in trajs for d in tr.digests]
        out.logits_digest = LogitsDigests(np.stack(rows) if rows else
                                          np.zeros((0, DIGEST_BYTES), np.uint8),
                                          log.digest_algo or default_algo())
    return out
