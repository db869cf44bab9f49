"""The trainer's configuration: one dataclass every trainer reads — :class:`~.fsdp.trainer.FSDPTrainer`,
:class:`~.megatron.trainer.MegatronTrainer`, :class:`~.invariant_trainer.InvariantTrainer` — and the
loop's configurations (:class:`~.loop.LoopConfig`) and the seed recipes
(:class:`~.seed_recipes.SeedRecipe`) embed as their ``trainer`` field.

One default per concept, the numbers ``skyrl-numerics train`` runs with on the tiny models (lr
1e-2, no weight decay, 16 sequences per micro-batch); a real model wants its own ``lr``.

LoRA on an HF model: ``lora_patterns`` are globs over module names (``"*.q_proj"``, a fused
experts module ``"model.layers.*.mlp.experts"``). A serving plan's and a seed recipe's
``lora_targets`` are linear *groups* (attention, dense, shared, experts); the published trainer
turns groups into patterns in one place (:func:`~.published.lora_patterns_for`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Sequence

from skyrl_numerics import correction
from skyrl_numerics.errors import InputError

from .losses import AGGREGATIONS

__all__ = ["TrainerConfig", "correction_fn", "DEFAULT_LORA_PATTERNS"]

#: the LoRA modules of an HF model when none are named: the attention projections
DEFAULT_LORA_PATTERNS = ("*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj")
_NOT_CORRECTIONS = ("Correction", "combine")


@dataclass
class TrainerConfig:
    """Everything one update needs (GRPO, DAPO-style clip-higher PPO)."""

    advantage: str = "grpo"              # "grpo" | "rloo"
    std_normalize: bool = True           # GRPO: divide by the group std
    adv_eps: float = 1e-6
    eps_low: float = 0.2
    eps_high: float = 0.28               # clip-higher (DAPO)
    dual_clip: float | None = None
    aggregation: str = "token_mean"      # | "seq_mean_token_mean"
    lr: float = 1e-2
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0
    micro_batch_size: int = 16           # sequences per forward
    token_chunk: int = 1024              # lm-head rows per chunk
    pad_id: int = 0
    temperature: float | None = None     # None: the rollout's sampling temperature
    # the invariant trainer's backward: "fixed" (the fixed-order kernels: run-to-run identical
    # gradients) or "stock" (torch's fp32 GEMM for the matmuls' gradients; the forward, and so
    # Δ = 0, unchanged: kernels.stock_backward)
    invariant_backward: str = "fixed"
    # alignment pieces
    batch_invariant: bool = False
    use_support: bool = False
    route_replay: bool = False
    qat: str | list | None = None        # recipe for the experts, or apply_qat rules
    # f(trainer_lp, rollout_lp, cu_seqlens=) -> Correction, or a skyrl_numerics.correction name
    correction: Callable | str | None = None
    correction_kwargs: dict = field(default_factory=dict)   # e.g. {"cap": 2.0} for token_tis
    # LoRA on the HF model's modules (rank 0: off)
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_patterns: Sequence[str] = DEFAULT_LORA_PATTERNS
    reshard_after_forward: bool = True

    def __post_init__(self):
        if self.advantage not in ("grpo", "rloo"):
            raise InputError(f"unknown advantage {self.advantage!r}; expected 'grpo' or 'rloo'", field="advantage")
        if self.aggregation not in AGGREGATIONS:
            raise InputError(f"unknown aggregation {self.aggregation!r}; expected one of {AGGREGATIONS}",
                             field="aggregation")
        if self.micro_batch_size < 1:
            raise InputError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}", field="micro_batch_size")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise InputError(f"grad_clip must be > 0 or None, got {self.grad_clip}", field="grad_clip")
        if not (0 <= self.eps_low < 1 and 0 <= self.eps_high):
            raise InputError(f"clip range eps_low={self.eps_low}, eps_high={self.eps_high}", field="eps_low")
        if self.invariant_backward not in ("fixed", "stock"):
            raise InputError(f"unknown invariant_backward {self.invariant_backward!r}; expected 'fixed' "
                             "or 'stock'", field="invariant_backward")
        if isinstance(self.correction, str):
            correction_fn(self.correction)      # a known name, refused here otherwise

    def correction_callable(self) -> Callable | None:
        """``correction`` with ``correction_kwargs`` bound (a name resolved in
        :mod:`skyrl_numerics.correction`), or None."""
        return correction_fn(self.correction, self.correction_kwargs)


def correction_fn(spec, kwargs: dict | None = None):
    """A correction callable from a callable or a :mod:`skyrl_numerics.correction` name, with
    ``kwargs`` bound; unknown names are refused naming the field."""
    if spec is None:
        return None
    if not callable(spec):
        fn = getattr(correction, str(spec), None)
        if fn is None or spec not in correction.__all__ or spec in _NOT_CORRECTIONS:
            names = [n for n in correction.__all__ if n not in _NOT_CORRECTIONS]
            raise InputError(f"unknown correction {spec!r}; expected one of {names} or a callable",
                             field="correction")
        spec = fn
    return functools.partial(spec, **kwargs) if kwargs else spec
