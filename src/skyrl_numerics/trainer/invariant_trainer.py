"""Training through the invariant forward: true on-policy RL, and the exact on-policy gradient.

:class:`InvariantTrainer` keeps fp32 master weights and a working copy in the model dtype (bf16) —
the weights the engine serves. Its forward is the invariant forward the vLLM engine runs, so at the
start of an on-policy step its logprobs equal the engine's bit for bit (mean |Δ| = 0) and the PPO
ratio is exactly 1. The backward flows through the invariant ops' own backward
(``skyrl_numerics.kernels.matmul``/``rms_norm``); attention, whose kernel is forward-only, keeps its
forward bits and takes its backward from the fp64 reference formula recomputed on the same inputs
(:class:`skyrl_numerics.invariant.autograd.TrainableAttention`, used by ``InvariantCausalLM.attention_op`` whenever grad is on). The update: gradients of the bf16 copy -> fp32 master -> AdamW -> bf16 copy.
With ``TrainerConfig(invariant_backward="stock")`` the matmuls' gradient GEMMs run on torch's fp32
GEMM instead (:func:`skyrl_numerics.kernels.stock_backward`): the forward, hence Δ = 0 with the
engine, is unchanged; the gradients are no longer identical from run to run (BENCHMARKS.md, RL
step cost: what it saves).

:func:`onpolicy_gradient` is the reference the other configurations are measured against: the
gradient of the PPO surrogate at ratio 1 — ``-(1/N) Σ_t A_t ∇ log π(y_t)`` — where ``π`` is the
sampling distribution as the bitwise engine computes it (invariant forward at the served weights,
renormalized over the sampled support when the engine truncated it). For the ``bitwise``
configuration it is that configuration's own gradient, bit for bit; for the others the cosine and
relative error of their gradient against it measure the bias their mismatch puts into the update
(``grad_cos_onpolicy``, ``grad_relerr_onpolicy``).
"""
from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from skyrl_numerics.invariant.base import InvariantCausalLM
from skyrl_numerics.kernels import stock_backward
from skyrl_numerics.rollout import Rollout

from .config import TrainerConfig


def trainable_names(model: InvariantCausalLM) -> list[str]:
    """HF names of the trained weights (the router's correction bias is a buffer in HF); under a
    LoRA plan only the adapters (the base is frozen, quantized weights packed)."""
    if model.numerics is not None and model.numerics.lora:
        return model.adapter_names()
    return [n for n in model.hf_names()
            if not n.endswith("e_score_correction_bias") and n not in model._packed]


def sequence_logprobs(model: InvariantCausalLM, rollout: Rollout, *, batch_size: int = 8,
                      use_support: bool = False, temperature: float | None = None):
    """Differentiable float32 response-token logprobs ``[Σ response_len]`` (same numbers as
    :func:`~skyrl_numerics.trainer.logprobs.invariant_trainer_logprobs`) and the no-grad entropy."""
    from skyrl_numerics.invariant.rollout_forward import entropy_of, response_logps, support_mask

    if temperature is None:
        temperature = float(rollout.sampling.get("temperature", 1.0) or 1.0)
    mask = support_mask(model, rollout) if use_support else None
    pieces: list[list] = [[] for _ in range(len(rollout))]
    ents: list[list] = [[] for _ in range(len(rollout))]
    for i, logp, tok, _off, _n, _lo in response_logps(model, rollout, batch_size, temperature, mask):
        pieces[i].append(tok)
        ents[i].append(entropy_of(logp.detach()))
    return torch.cat([t for p in pieces for t in p]), torch.cat([t for e in ents for t in e])


def _advantages(rollout: Rollout, rewards) -> torch.Tensor:
    from skyrl_numerics.trainer.losses import compute_advantages, token_advantages

    seq = compute_advantages("grpo", torch.from_numpy(np.asarray(rewards, dtype=np.float64)),
                             rollout.group_ids)
    return token_advantages(seq.float(), rollout.response_cu)


def _surrogate(lp, old, adv, *, weights=None, mask=None, eps_low=0.2, eps_high=0.28):
    from skyrl_numerics.trainer.losses import ppo_clip_loss

    return ppo_clip_loss(lp, old, adv, mask=mask, weights=weights, eps_low=eps_low,
                         eps_high=eps_high, aggregation="token_mean")


def _grads(model: InvariantCausalLM, names) -> dict[str, torch.Tensor]:
    """The weights' gradients in fp32 (a bf16 gradient widened: a new tensor; an fp32 one taken
    as it is — the caller sets ``.grad`` to None right after, so nothing else writes it)."""
    return {n: (model.w(n).grad.detach().float() if model.w(n).grad is not None
                else torch.zeros(model.w(n).shape)) for n in names}


def onpolicy_gradient(model: InvariantCausalLM, rollout: Rollout, rewards, *,
                      use_support: bool = False) -> dict[str, torch.Tensor]:
    """The exact on-policy gradient of the PPO surrogate (ratio 1, token mean) at ``model``'s
    weights, by HF name, fp32. See the module doc."""
    names = trainable_names(model)
    for n in names:
        model.w(n).requires_grad_(True)
        model.w(n).grad = None
    try:
        with torch.enable_grad():
            lp, _ = sequence_logprobs(model, rollout, use_support=use_support)
            mask = torch.from_numpy(rollout.loss_mask) if rollout.is_multi_turn else None
            _surrogate(lp, lp.detach(), _advantages(rollout, rewards), mask=mask).loss.backward()
        return _grads(model, names)
    finally:
        for n in names:
            model.w(n).requires_grad_(False)
            model.w(n).grad = None


def compare_gradients(g: dict, ref: dict) -> dict:
    """``grad_cos_onpolicy`` = cos(g, ref), ``grad_relerr_onpolicy`` = |g - ref| / |ref| over all
    shared names (flattened, float64)."""
    names = sorted(set(g) & set(ref))
    dot = sum(float((g[n].double() * ref[n].double()).sum()) for n in names)
    ng = math.sqrt(sum(float(g[n].double().pow(2).sum()) for n in names))
    nr = math.sqrt(sum(float(ref[n].double().pow(2).sum()) for n in names))
    nd = math.sqrt(sum(float((g[n].double() - ref[n].double()).pow(2).sum()) for n in names))
    return {"grad_cos_onpolicy": dot / (ng * nr) if ng and nr else math.nan,
            "grad_relerr_onpolicy": nd / nr if nr else math.nan}


class InvariantTrainer:
    """PPO/GRPO steps through the invariant forward (see the module doc).

    ``step`` returns the FSDP trainer's metric names (loss, clipfrac, entropy, ...) and keeps the
    step's gradient (before clipping) in ``last_grads`` by HF name and its forward's logprobs
    (before the optimizer step: the old policy's, bit for bit those of :meth:`logprobs`) in
    ``last_logprobs``."""

    def __init__(self, model_dir, config: TrainerConfig | None = None, *, kv_cache=None,
                 numerics=None):
        from skyrl_numerics.invariant import from_checkpoint

        self.config = cfg = config or TrainerConfig()
        self.model = from_checkpoint(model_dir, kv_cache=kv_cache, numerics=numerics)
        self.names = trainable_names(self.model)
        self.master = {n: torch.nn.Parameter(self.model.w(n).detach().float().clone())
                       for n in self.names}
        self.optimizer = torch.optim.AdamW(list(self.master.values()), lr=cfg.lr, betas=tuple(cfg.betas),
                                           eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
        self.use_support, self.grad_clip = cfg.use_support, cfg.grad_clip
        self.last_grads: dict[str, torch.Tensor] = {}
        self.last_logprobs: np.ndarray | None = None
        self.global_step = 0

    @torch.no_grad()
    def logprobs(self, rollout: Rollout) -> np.ndarray:
        from skyrl_numerics.trainer.logprobs import invariant_trainer_logprobs

        return invariant_trainer_logprobs(self.model, rollout, batch_size=8,
                                          use_support=self.use_support).logprobs

    def served_state(self) -> dict[str, torch.Tensor]:
        """The weights as the engine serves them (HF names, model dtype); under a LoRA plan
        only the adapters (the engine loaded the same frozen base from the checkpoint)."""
        names = self.names if self.model.adapter_names() else self.model.hf_names()
        return {n: self.model.w(n).detach().clone() for n in names}

    def step(self, rollout: Rollout, rewards, *, old_logprobs=None) -> dict:
        """One update (:func:`..ppo_step.ppo_update`, GRPO, token mean): the whole rollout is one
        micro-batch through the invariant forward; the gradient lands on the model's weights,
        then the fp32 masters take the AdamW step and are written back in the model dtype."""
        from types import SimpleNamespace

        from skyrl_numerics.trainer.ppo_step import ppo_update

        whole = SimpleNamespace(token_index=np.arange(rollout.num_response_tokens, dtype=np.int64),
                                cu_seqlens=np.asarray(rollout.response_cu, dtype=np.int64))
        return ppo_update(rollout, rewards, self.config, micro_batches=[whole],
                          forward=lambda _mb: self._forward(rollout),
                          update=self._update, old_logprobs=old_logprobs, context=self._grads_on)

    def _forward(self, rollout: Rollout):
        """The update's differentiable forward; its logprobs kept (detached) in ``last_logprobs``."""
        lp, ent = sequence_logprobs(self.model, rollout, use_support=self.use_support)
        self.last_logprobs = lp.detach().numpy().copy()
        return lp, ent

    @contextlib.contextmanager
    def _grads_on(self):
        """The model's trained weights require grad inside; their gradients are kept in
        ``last_grads`` (HF names, fp32) and cleared on the way out."""
        for n in self.names:
            self.model.w(n).requires_grad_(True)
            self.model.w(n).grad = None
        backward = (stock_backward() if self.config.invariant_backward == "stock"
                    else contextlib.nullcontext())
        try:
            with torch.enable_grad(), backward:
                yield
            self.last_grads = _grads(self.model, self.names)
        finally:
            for n in self.names:
                self.model.w(n).requires_grad_(False)
                self.model.w(n).grad = None

    def _update(self) -> tuple[float, int]:
        """``clip_grad_norm_`` then AdamW on the fp32 masters, the masters rounded into the
        model's weights. The clip's arithmetic is torch's (``get_total_norm``, then every
        gradient times ``clamp(max_norm / (norm + 1e-6), max=1)``); when that factor is 1 the
        product is the gradient itself, so ``last_grads`` serve as the masters' gradients
        without a copy (AdamW does not write its gradients), else scaled copies do."""
        grads = [self.last_grads[n] for n in self.master]
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        max_norm = self.grad_clip if self.grad_clip else math.inf
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        keep = bool(coef == 1.0)
        for p, g in zip(self.master.values(), grads):
            p.grad = g if keep else g * coef
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for n, p in self.master.items():
                self.model.w(n).copy_(p.detach())       # (rounded to the model dtype as .to())
        gn = float(norm)
        self.global_step += 1
        return gn, self.global_step
