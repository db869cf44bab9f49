"""The engine's batch layout, as the trainer emulates it (for :func:`~.hf_forward.vllm_cpu_rope`).

vLLM CPU's rotary kernel on MLA's 3-D views rotates each query head and key by a position that
depends on how the engine batched the tokens (docs/mla.md). This module turns engine steps into
those positions: :func:`lockstep_schedule` (the steps assumed when none were recorded),
:func:`recorded_steps` (the steps an engine with ``MLAScheduleExtension`` recorded, mapped to a
rollout's rows) and :func:`cpu_rope_positions` (per request, the position of each head and key).
"""
from __future__ import annotations

from typing import Sequence


def lockstep_schedule(prompt_lens: Sequence[int], response_lens: Sequence[int]):
    """The engine steps of one ``generate`` call over these requests, assuming (as in the doctor:
    equal prompts, a token budget above ``Σ prompt_lens``) that every prompt is prefilled in
    the first step, in request order, and every later step decodes one token of each request still
    running, in request order. A step is a list of ``(row, first_position, n_tokens)``. The last
    response token is sampled, never fed back, so request ``i`` is fed
    ``prompt_lens[i] + response_lens[i] - 1`` tokens."""
    P = [int(x) for x in prompt_lens]
    R = [int(x) for x in response_lens]
    steps = [[(i, 0, P[i]) for i in range(len(P))]]
    for k in range(1, max(R, default=0)):
        step = [(i, P[i] + k - 1, 1) for i in range(len(P)) if R[i] > k]
        if step:
            steps.append(step)
    return steps


def _key_row_stride(config) -> int:
    """Token stride of ``k_pe`` in rows of ``qk_rope_head_dim`` (see :func:`vllm_cpu_rope`)."""
    R = config.qk_rope_head_dim
    width = (config.q_lora_rank or 0) + config.kv_lora_rank + R
    if width % R:
        raise NotImplementedError(f"q_lora_rank + kv_lora_rank + qk_rope_head_dim = {width} is not "
                                  f"a multiple of qk_rope_head_dim = {R}: the CPU rotary kernel's "
                                  "rows then straddle two tokens, which this emulation does not "
                                  "model")
    return width // R


def cpu_rope_positions(prompt_lens: Sequence[int], response_lens: Sequence[int], config,
                       steps=None):
    """Per request, the ``[heads + 1, prompt_len + response_len]`` positions vLLM CPU's rotary
    kernel rotated each query head and (last row) the key by (see :func:`vllm_cpu_rope`), for the
    engine ``steps`` (default :func:`lockstep_schedule`). Positions never fed to the engine (the
    last response token) keep their own position. ``config``: the model's DeepseekV3 config."""
    import numpy as np

    H = config.num_attention_heads
    kstride = _key_row_stride(config)
    P = [int(x) for x in prompt_lens]
    R = [int(x) for x in response_lens]
    out = [np.tile(np.arange(P[i] + R[i]), (H + 1, 1)) for i in range(len(P))]
    steps = lockstep_schedule(P, R) if steps is None else steps
    for step in steps:
        toks = [(row, p) for row, start, n in step for p in range(start, start + n)]
        T = len(toks)
        for t, (row, p) in enumerate(toks):
            out[row][:, p] = 0                                   # not rotated, unless ...
        for r in range(T):                                       # ... kernel row r reaches it
            row, p = toks[r // H]
            out[row][r % H, p] = toks[r][1]
        for t in range(0, (T - 1) // kstride + 1):
            row, p = toks[t]
            out[row][H, p] = toks[t * kstride][1]
    return out


def recorded_steps(generator, rollout, *, clear: bool = True):
    """The engine steps that produced ``rollout``, from an engine started with
    :class:`MLAScheduleExtension`, as :func:`cpu_rope_positions` takes them (a list of steps, each
    ``[(row, first_position, n_tokens), ...]`` in batch order). Requests are matched to rollout
    rows by their prompt tokens (and in request order among equal prompts); steps of other
    ``generate`` calls (warm-up) are dropped."""
    raw = generator.llm.collective_rpc("skyrl_mla_schedule_fetch", args=(clear,))[0]
    first: dict[str, list] = {}
    for reqs, pos, tok in raw:
        for r, p, t in zip(reqs, pos, tok):
            seen = first.setdefault(r, [])
            if p == len(seen):
                seen.append(t)
    rows: dict[str, int] = {}
    taken: set[int] = set()
    for r in sorted(first, key=lambda x: (len(x), x)):
        pr = first[r]
        for i in range(len(rollout)):
            P = int(rollout.prompt_lens[i])
            if i not in taken and len(pr) >= P and pr[:P] == rollout.prompt(i).tolist():
                rows[r] = i
                taken.add(i)
                break
    missing = [i for i in range(len(rollout)) if i not in taken]
    if missing:
        raise RuntimeError(f"recorded engine steps: no request found for rollout rows {missing}")
    steps = []
    for reqs, pos, _ in raw:
        step = []
        for r, p in zip(reqs, pos):
            if r not in rows:
                continue
            row = rows[r]
            if step and step[-1][0] == row and step[-1][1] + step[-1][2] == p:
                step[-1] = (row, step[-1][1], step[-1][2] + 1)
            else:
                step.append((row, p, 1))
        if step:
            if len(step) != len({row for row, _, _ in step}) or any(
                    r not in rows for r in reqs):
                # a step mixing this rollout with another generate call, or a request split
                raise RuntimeError("recorded engine steps: a step mixes requests of this rollout "
                                   "with others (or splits one); the layout cannot be mapped")
            steps.append(step)
    return steps
