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

Supports (top-p / top-k replay): a model token's row is the set the sampler kept in its turn; an
observation token's row is the token alone (never trained on, so never read by the loss).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np

from skyrl_numerics.errors import InputError
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


def generate_multiturn(gen, prompts: Sequence[Sequence[int]], env: Callable[[], Env], *,
                       max_turns: int = 4, max_tokens: int = 16, n: int = 1, seed: int = 0,
                       temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                       capture_support: bool | str = False, routes: bool | None = None,
                       route_deltas: bool = True, ignore_eos: bool = True,
                       topk_logprobs: int = 0, logits_digest: bool = False) -> Rollout:
    """``n`` trajectories per prompt (rows grouped by prompt, as ``generate``) through ``gen``
    (a :class:`~.generator.VLLMGenerator` or :class:`~.remote.RemoteGenerator`); see the module
    doc. ``routes``: ``None`` takes them when the engine captures them, ``True`` requires them.
    Trajectory ``i``'s turn ``t`` samples with seed ``seed + 1000 t + i``. ``topk_logprobs``:
    the engine's top-K per model token in ``ro.topk`` (observation rows: ids 0, values NaN;
    ``TopkCheck(mask=loss_mask)`` skips them). ``logits_digest``: the engine's full-row digest
    per model token in ``ro.logits_digest`` (observation rows: zeros; ``DigestCheck(mask=)``)."""
    if int(max_turns) < 1:
        raise InputError(f"max_turns must be >= 1, got {max_turns}", field="max_turns")
    if not callable(env):
        raise InputError("env must be a factory (a class or zero-argument callable) giving one "
                         "environment per trajectory", field="env")
    num_experts = _num_experts(gen) if routes is not False else None
    if routes and num_experts is None:
        raise InputError("routes asked for but the engine captures none (an MoE model with route "
                         "capture on)", field="routes")
    vocab = getattr(gen, "vocab_size", None)
    max_len = getattr(gen, "max_model_len", None) or (1 << 62)
    traj = [(p, j) for p in range(len(prompts)) for j in range(n)]
    envs = []
    for p, _ in traj:
        e = env()
        e.reset([int(t) for t in prompts[p]])
        envs.append(e)
    B = len(traj)
    hist = [[int(t) for t in prompts[p]] for p, _ in traj]
    resp = [[] for _ in range(B)]
    lps = [[] for _ in range(B)]
    mask = [[] for _ in range(B)]
    turn_of = [[] for _ in range(B)]
    sup = [[] for _ in range(B)]
    top = [[] for _ in range(B)]    # (ids [K], values [K]) per response token
    dig = [[] for _ in range(B)]    # digest [16] per response token
    algo = None
    pending: list[list[int]] = [[] for _ in range(B)]
    reward = np.zeros(B)
    traces = [None] * B
    bytes_delta = bytes_full = 0
    cached, elapsed, active = [], 0.0, list(range(B))
    ro = None
    for t in range(int(max_turns)):
        active = [i for i in active if len(hist[i]) + max_tokens <= max_len]
        if not active:
            break
        starts = None
        if num_experts is not None:
            starts = [(traces[i].num_tokens if traces[i] is not None else 0) if route_deltas else 0
                      for i in active]
        ro = gen.generate([hist[i] for i in active], n=1, seeds=[seed + 1000 * t + i for i in active],
                          max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                          capture_support=capture_support, ignore_eos=ignore_eos, route_starts=starts,
                          **({"topk_logprobs": topk_logprobs} if topk_logprobs else {}),
                          **({"logits_digest": True} if logits_digest else {}))
        if logits_digest:
            algo = ro.logits_digest.algo
        elapsed += float(ro.meta.get("generate_s") or 0.0)
        cached.append([int(c) for c in ro.meta.get("num_cached_tokens", [0] * len(active))])
        deltas = ro.meta.pop("route_deltas", None)
        if num_experts is not None and deltas is None:
            if routes or t > 0:
                raise InputError(f"turn {t}: the engine sent no routes (a server needs "
                                 "--enable-return-routed-experts)", field="routes")
            num_experts = None       # routes=None (auto): this engine captures none
        still = []
        for k, i in enumerate(active):
            toks = [int(x) for x in ro.response(k)]
            if not toks:        # nothing sampled: the trajectory ends, its pending observation with it
                continue
            for o in pending[i]:
                resp[i].append(o); lps[i].append(None); mask[i].append(False); turn_of[i].append(t)
                sup[i].append(np.asarray([o], np.int64))
                if topk_logprobs:
                    top[i].append((np.zeros(topk_logprobs, np.int32),
                                   np.full(topk_logprobs, np.nan, np.float32)))
                if logits_digest:
                    dig[i].append(np.zeros(ro.logits_digest.digests.shape[1], np.uint8))
            pending[i] = []
            a, b = int(ro.response_cu[k]), int(ro.response_cu[k + 1])
            for j, x in enumerate(toks):
                resp[i].append(x); lps[i].append(float(ro.rollout_logprobs[a + j]))
                mask[i].append(True); turn_of[i].append(t)
                if ro.support is not None:
                    sup[i].append(np.asarray(ro.support.row(a + j), np.int64))
                if topk_logprobs:
                    top[i].append((ro.topk.ids[a + j], ro.topk.values[a + j]))
                if logits_digest:
                    dig[i].append(ro.logits_digest.digests[a + j])
            if deltas is not None:
                start, rows = deltas[k]
                rows = np.asarray(rows)
                if traces[i] is None:
                    from skyrl_numerics.replay import RouteTrace

                    traces[i] = RouteTrace(rows.shape[1], rows.shape[2], num_experts)
                bytes_delta += rows.nbytes
                bytes_full += (len(hist[i]) + len(toks) - 1) * rows.shape[1] * rows.shape[2] * rows.itemsize
                traces[i].add(rows, start, allow_overlap=not route_deltas)
            hist[i] += toks
            st = envs[i].step(toks)      # after every model turn, the last one too (its reward)
            reward[i] += float(st.reward)
            obs = _checked_observation(st.observation, vocab, i, t)
            if st.done or not obs or t + 1 == max_turns:
                continue
            pending[i] = obs
            hist[i] += obs
            still.append(i)
        active = still
    out = _assemble(gen, prompts, traj, resp, lps, mask, turn_of, sup, traces, reward, num_experts,
                     ro, dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, n=n,
                              max_tokens=max_tokens, max_turns=int(max_turns),
                              logprobs_mode="processed_logprobs"),
                     dict(generate_s=elapsed, num_cached_tokens_per_turn=cached,
                          route_bytes={"delta": int(bytes_delta), "full_resend": int(bytes_full)},
                          route_deltas=bool(route_deltas)),
                     capture_support)
    if topk_logprobs:
        from skyrl_numerics.gap.topk import TopkLogprobs

        rows = [r for t_ in top for r in t_]
        k = int(topk_logprobs)
        out.topk = TopkLogprobs(np.stack([r[0] for r in rows]) if rows else np.zeros((0, k), np.int32),
                                np.stack([r[1] for r in rows]) if rows else np.zeros((0, k), np.float32))
    if logits_digest:
        from skyrl_numerics.gap.digest import DIGEST_BYTES, LogitsDigests, default_algo

        rows = [d for d_ in dig for d in d_]
        out.logits_digest = LogitsDigests(np.stack(rows) if rows else
                                          np.zeros((0, DIGEST_BYTES), np.uint8), algo or default_algo())
    return out


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


def _assemble(gen, prompts, traj, resp, lps, mask, turn_of, sup, traces, reward, num_experts, ro,
              sampling, meta, capture_support) -> Rollout:
    from skyrl_numerics.replay import PackedRoutes, PackedSupport

    routes = None
    if num_experts is not None and all(tr is not None for tr in traces):
        for i, tr in enumerate(traces):
            tr.check_length(len(prompts[traj[i][0]]) + len(resp[i]))
        routes = PackedRoutes.from_sequences([tr.to_routes().values for tr in traces], num_experts)
    support = None
    if capture_support:
        support = PackedSupport.from_sets([row for rows in sup for row in rows],
                                          vocab_size=getattr(gen, "vocab_size", None))
    info = getattr(gen, "info", None)
    n_model = sum(sum(m) for m in mask)
    meta = {**meta, "model_dir": getattr(gen, "model_dir", None), "env_reward": reward.tolist(),
            "tokens_per_s": n_model / meta["generate_s"] if meta["generate_s"] > 0 else None}
    return Rollout.from_lists([list(prompts[p]) for p, _ in traj], resp, lps,
                              loss_mask=mask, turns=turn_of,
                              group_ids=np.asarray([p for p, _ in traj]), routes=routes,
                              support=support, sampling=sampling,
                              engine=getattr(info, "name", "vllm"),
                              engine_version=getattr(info, "version", "unknown"), meta=meta)
