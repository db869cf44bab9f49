"""One ``generate()`` call, whatever the transport: the checked request and the ``Rollout`` built
from what the engine returned.

Both engine clients run the same steps and differ only in how requests travel —
:class:`~.generator.VLLMGenerator` hands ``vllm.SamplingParams`` to an in-process ``llm.generate``,
:class:`~.remote.RemoteGenerator` sends one ``/v1/completions`` request per prompt:

1. :func:`check_generate`: the call's arguments, checked against the engine's limits, as a
   :class:`Request` (whether a support is read from the processed logprobs or captured inside the
   engine, how many logprobs per token to ask for, the seed of each prompt);
2. :meth:`Request.params`: prompt ``i``'s sampling parameters (``SamplingParams`` fields);
3. each returned sample goes to :meth:`Samples.add` (prompt and response ids, the sampled tokens'
   logprobs, the top logprobs a support or the top-K is read from);
4. the transport fetches what its engine recorded beside the tokens (routes, in-engine supports,
   logits digests);
5. :func:`assemble_rollout`: the ``Rollout`` (sampling dict, meta, route deltas, top-K).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from skyrl_numerics.errors import InputError
from skyrl_numerics.gap.topk import TopkLogprobs
from skyrl_numerics.replay import PackedSupport
from skyrl_numerics.rollout import Rollout


def check_request(prompts, *, vocab_size: int, max_model_len: int, max_logprobs: int,
                  max_tokens: int, capture_support, top_k: int, top_p: float,
                  temperature: float) -> tuple[bool, int]:
    """Check one ``generate`` call (every engine client: :class:`VLLMGenerator`,
    :class:`~skyrl_numerics.engine.remote.RemoteGenerator`); returns ``(in_engine,
    n_logprobs)``: whether the support must be captured inside the engine, and how many
    logprobs per token to request."""
    if not len(prompts):
        raise InputError("no prompts", field="prompts")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise InputError("empty prompt", row=i, field="prompts")
        bad = [t for t in p if not 0 <= int(t) < vocab_size]
        if bad:
            raise InputError(f"token id {bad[0]} outside the vocabulary [0, {vocab_size})",
                             row=i, field="prompts")
        if len(p) + max_tokens > max_model_len:
            raise InputError(f"prompt ({len(p)}) + max_tokens ({max_tokens}) exceeds "
                             f"max_model_len {max_model_len}", row=i, field="prompts")
    if capture_support not in (False, True, "auto", "sampler", "logprobs"):
        raise InputError(f"capture_support must be a bool, 'auto', 'sampler' or 'logprobs', "
                         f"got {capture_support!r}", field="capture_support")
    if capture_support == "logprobs" and not 1 < top_k < max_logprobs:
        raise InputError(f"capture_support='logprobs' needs 1 < top_k < max_logprobs "
                         f"({max_logprobs}): the support is read from the top "
                         "processed logprobs", field="top_k")
    in_engine = capture_support == "sampler" or (
        capture_support in (True, "auto") and not 1 < top_k < max_logprobs)
    if in_engine and top_k <= 0 and top_p >= 1.0:
        raise InputError("capture_support with neither top_k nor top_p < 1: the support is the "
                         "whole vocabulary (nothing to capture)", field="top_k")
    if in_engine and temperature <= 0:
        raise InputError("capture_support needs temperature > 0 (greedy sampling has no "
                         "support set)", field="temperature")
    n_logprobs = logprobs_for_support(top_k, max_logprobs) if capture_support and not in_engine else 0
    return in_engine, n_logprobs


def logprobs_for_support(top_k: int, max_logprobs: int) -> int:
    """How many processed logprobs per token to request so a top-k support can be read from them:
    ``min(2 top_k + 1, max_logprobs)``. More entries than ``top_k``: vLLM's top-k keeps every token
    tied with the k-th logit (bf16 logits tie often), so the support can exceed k. At least one
    returned entry must come back at ``-inf``, proving the support ended inside what was returned
    (``PackedSupport.from_topk_logprobs(..., requested=n)`` checks it)."""
    return min(2 * top_k + 1, max_logprobs)


def check_route_starts(route_starts, prompts) -> list[int] | None:
    """``route_starts``: ``None``, or one int per prompt in ``[0, len(prompt)]``."""
    if route_starts is None:
        return None
    starts = [int(x) for x in route_starts]
    if len(starts) != len(prompts):
        raise InputError(f"{len(starts)} route starts for {len(prompts)} prompts",
                         field="route_starts")
    for i, (a, p) in enumerate(zip(starts, prompts)):
        if not 0 <= a <= len(p):
            raise InputError(f"route start {a} outside [0, {len(p)}] (the prompt's length)",
                             field="route_starts", row=i)
    return starts


@dataclass(frozen=True)
class Request:
    """One checked ``generate`` call (:func:`check_generate`), transport aside."""
    prompts: Sequence[Sequence[int]]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    seed: int | None
    n: int
    capture_support: bool | str
    ignore_eos: bool
    topk_logprobs: int
    seeds: Sequence[int] | None
    route_starts: list[int] | None   # checked: one per prompt, or None
    in_engine: bool                  # the support is captured inside the engine (its sampler)
    n_logprobs: int                  # logprobs per token a support is read from (0: none)

    @property
    def support_from_logprobs(self) -> bool:
        """The support is read from the processed top logprobs (``1 < top_k < max_logprobs``)."""
        return bool(self.capture_support) and not self.in_engine

    @property
    def reads_top_logprobs(self) -> bool:
        """Each token's top logprobs are read (a support or the top-K come from them)."""
        return self.support_from_logprobs or bool(self.topk_logprobs)

    def prompt_ids(self, i: int) -> list[int]:
        return [int(t) for t in self.prompts[i]]

    def seed_of(self, i: int) -> int | None:
        """Prompt ``i``'s seed: ``seeds[i]``, else ``seed + i`` (``None``: unseeded)."""
        if self.seeds is not None:
            return int(self.seeds[i])
        return None if self.seed is None else self.seed + i

    def params(self, i: int) -> dict[str, Any]:
        """Prompt ``i``'s sampling parameters, as ``vllm.SamplingParams`` keywords (``top_k``
        only when > 0, ``seed`` only when seeded)."""
        kw = dict(temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens,
                  n=self.n, logprobs=max(self.n_logprobs, self.topk_logprobs),
                  ignore_eos=self.ignore_eos)
        if self.top_k > 0:
            kw["top_k"] = self.top_k
        seed = self.seed_of(i)
        if seed is not None:
            kw["seed"] = seed
        return kw

    def sampling(self) -> dict:
        """The rollout's ``sampling`` record."""
        return dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                    seed=self.seed, n=self.n, max_tokens=self.max_tokens,
                    logprobs_mode="processed_logprobs")


def check_generate(prompts, *, vocab_size: int, max_model_len: int, max_logprobs: int,
                   temperature: float, top_p: float, top_k: int, max_tokens: int,
                   seed: int | None, n: int, capture_support, ignore_eos: bool,
                   topk_logprobs: int, seeds, route_starts) -> Request:
    """Every check of a ``generate`` call against the engine's limits (InputError naming the
    field); the :class:`Request` to send."""
    in_engine, n_logprobs = check_request(
        prompts, vocab_size=vocab_size, max_model_len=max_model_len, max_logprobs=max_logprobs,
        max_tokens=max_tokens, capture_support=capture_support, top_k=top_k, top_p=top_p,
        temperature=temperature)
    if not 0 <= topk_logprobs <= max_logprobs:
        raise InputError(f"topk_logprobs must be in [0, max_logprobs {max_logprobs}], "
                         f"got {topk_logprobs}", field="topk_logprobs")
    if seeds is not None and len(seeds) != len(prompts):
        raise InputError(f"{len(seeds)} seeds for {len(prompts)} prompts", field="seeds")
    return Request(prompts, temperature, top_p, top_k, max_tokens, seed, n, capture_support,
                   ignore_eos, topk_logprobs, seeds, check_route_starts(route_starts, prompts),
                   in_engine, n_logprobs)


@dataclass
class Samples:
    """The returned samples of one request, in order (rows grouped by prompt)."""
    req: Request
    prompts: list = field(default_factory=list)      # prompt ids per sample
    responses: list = field(default_factory=list)    # response ids per sample
    logprobs: list = field(default_factory=list)     # the sampled tokens' logprobs per sample
    groups: list = field(default_factory=list)       # the prompt of each sample
    cached: list = field(default_factory=list)       # prefix-cache hits per prompt
    support_rows: list = field(default_factory=list)  # {id: logprob} per token (a support)
    topk_rows: list = field(default_factory=list)     # {id: logprob} per token (the top-K)

    def add(self, group: int, prompt: list, tokens: list, logprobs: list, top=None) -> None:
        """One sample. ``top`` (when :attr:`Request.reads_top_logprobs`): per token
        ``{id: (logprob, rank or None)}``, the engine's top logprobs; the top-K keeps those of
        rank <= K (no rank: all of them, :meth:`TopkLogprobs.from_dicts` takes the K largest)."""
        if top is not None and self.req.support_from_logprobs:
            self.support_rows.extend({k: lp for k, (lp, _) in d.items()} for d in top)
        if top is not None and self.req.topk_logprobs:
            K = self.req.topk_logprobs
            self.topk_rows.extend({k: lp for k, (lp, r) in d.items() if r is None or r <= K}
                                  for d in top)
        self.prompts.append(prompt)
        self.responses.append(tokens)
        self.logprobs.append(logprobs)
        self.groups.append(group)

    def route_starts(self) -> list[int] | None:
        """The request's route start of each sample (``None``: whole routes)."""
        starts = self.req.route_starts
        return None if starts is None else [starts[g] for g in self.groups]

    def support(self, vocab_size: int | None) -> PackedSupport | None:
        """The support read from the processed top logprobs (``None`` unless asked for so)."""
        if not self.req.support_from_logprobs:
            return None
        return PackedSupport.from_topk_logprobs(self.support_rows, requested=self.req.n_logprobs,
                                                vocab_size=vocab_size)


def assemble_rollout(gen, req: Request, samples: Samples, elapsed: float, *, routes=None,
                     support=None, digests=None, gates=None, index=None, **extra_meta) -> Rollout:
    """The ``Rollout`` of one call of ``gen`` (its ``model_dir``, ``dtype``, ``info``).
    ``routes``: PackedRoutes, or with route starts the ``[(start, rows)]`` per sample (then
    ``meta["route_deltas"]``); ``index``: PackedIndex, or with route starts ``[(start, rows)]``
    per sample (then ``meta["index_deltas"]``); ``extra_meta``: the transport's own meta entries."""
    n_tok = sum(len(r) for r in samples.responses)
    meta = dict(model_dir=gen.model_dir, dtype=gen.dtype, generate_s=elapsed,
                num_cached_tokens=samples.cached, **extra_meta,
                tokens_per_s=n_tok / elapsed if elapsed > 0 else None)
    if req.route_starts is not None:
        meta["route_deltas"], routes = routes, None
        if index is not None:
            meta["index_deltas"], index = index, None
    ro = Rollout.from_lists(samples.prompts, samples.responses, samples.logprobs,
                            group_ids=np.asarray(samples.groups), routes=routes, support=support,
                            gates=gates, index=index, sampling=req.sampling(), engine=gen.info.name,
                            engine_version=gen.info.version, meta=meta)
    if req.topk_logprobs:
        ro.topk = TopkLogprobs.from_dicts(samples.topk_rows, req.topk_logprobs)
    ro.logits_digest = digests
    return ro
