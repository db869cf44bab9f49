"""FSDP2 policy trainer: one PPO/GRPO update per :meth:`FSDPTrainer.step`, gloo on CPU, NCCL on GPU.

Sharding: every decoder layer is its own ``fully_shard`` unit and :class:`~.forward.PolicyModel`
(embedding, final norm, lm-head) is the root, all on a 1-D data-parallel mesh. Without a process
group (or with one rank) the same code runs unsharded: that is the single-process reference the
tests compare against.

One step on a :class:`~skyrl_numerics.rollout.Rollout` with per-sequence rewards ``R``:

1. advantages ``A`` from all rows (GRPO or RLOO, :mod:`.losses`); every rank computes the same;
2. rank ``k`` takes sequence block ``k`` (:func:`~.dist.shard_rows`) and splits it into
   micro-batches of ``micro_batch_size`` sequences;
3. ``log π_old``: given, or a no-grad pass (needed when an off-policy correction is on); with
   neither, ``log π_old = log π_θ`` detached (one update per batch: ratio ≡ 1);
4. the correction (``config.correction``, e.g. ``functools.partial(correction.token_tis, cap=2)``)
   on ``(log π_old, log π_rollout)`` gives weights ``w`` and keep mask ``m`` per rank (sequences
   are never split, so sequence-level masks see whole sequences);
5. the global denominator ``D`` (kept tokens, or kept sequences) is all-reduced, then each
   micro-batch backpropagates ``world · Σ_mb m w ℓ / D``; FSDP's gradient averaging over ranks
   divides the ``world`` back out, so the summed gradient is that of the full-batch loss;
6. gradient-norm clip, AdamW step.

The forward is switchable: ``batch_invariant`` (``skyrl_numerics.kernels.batch_invariant_mode``
around forward and backward), ``use_support`` (top-p/top-k support replay), ``route_replay`` (R3),
``qat`` (``skyrl_numerics.quant.apply_qat(model, recipe)`` before sharding), LoRA.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from skyrl_numerics.errors import InputError
from skyrl_numerics.rollout import Rollout

from ..dist import rank_and_world, shard_rows
from .forward import PolicyModel, make_micro_batch
from ..losses import AGGREGATIONS, compute_advantages, masked_mean, ppo_clip_loss, token_advantages
from ..step_parts import correct_micro_batches, kept_totals
from ..step_parts import old_logprobs as resolve_old_logprobs

__all__ = ["TrainerConfig", "FSDPTrainer"]


@dataclass
class TrainerConfig:
    """Everything one update needs. Defaults follow SkyRL/DAPO-style GRPO."""

    advantage: str = "grpo"              # "grpo" | "rloo"
    std_normalize: bool = True           # GRPO: divide by the group std
    adv_eps: float = 1e-6
    eps_low: float = 0.2
    eps_high: float = 0.28               # clip-higher (DAPO)
    dual_clip: float | None = None
    aggregation: str = "token_mean"      # | "seq_mean_token_mean"
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    weight_decay: float = 0.01
    grad_clip: float | None = 1.0
    micro_batch_size: int = 8            # sequences per forward
    token_chunk: int = 1024              # lm-head rows per chunk
    pad_id: int = 0
    temperature: float | None = None     # None: the rollout's sampling temperature
    # alignment pieces
    batch_invariant: bool = False
    use_support: bool = False
    route_replay: bool = False
    qat: str | list | None = None        # recipe for the experts, or apply_qat rules
    correction: Callable | str | None = None   # f(trainer_lp, rollout_lp, cu_seqlens=) -> Correction
    # LoRA (rank 0: off)
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: Sequence[str] = ("*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj")
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


def _correction_fn(spec):
    if spec is None or callable(spec):
        return spec
    from skyrl_numerics import correction

    fn = getattr(correction, str(spec), None)
    if fn is None or spec not in correction.__all__ or spec in ("Correction", "combine"):
        names = [n for n in correction.__all__ if n not in ("Correction", "combine")]
        raise InputError(f"unknown correction {spec!r}; expected one of {names} or a callable", field="correction")
    return fn


def _batch_invariant_context():
    try:
        from skyrl_numerics.kernels import batch_invariant_mode
    except ImportError:
        raise InputError("batch_invariant=True but skyrl_numerics.kernels.batch_invariant_mode is not available",
                         field="batch_invariant") from None
    return batch_invariant_mode()


def _apply_qat(model, qat):
    """``qat``: a recipe name (applied to the MoE experts, as the serving checkpoint quantizes
    them) or a list of ``skyrl_numerics.quant.apply_qat`` rules."""
    from skyrl_numerics.quant import apply_qat

    if isinstance(qat, str):
        from ..engine.serving_checkpoint import qat_rules

        qat = qat_rules(qat)
    apply_qat(model, qat)
    return model


def _decoder_layers(lm) -> list[torch.nn.Module]:
    body = getattr(lm, getattr(lm, "base_model_prefix", "model"), None) or lm.get_decoder()
    layers = getattr(body, "layers", None)
    if layers is None:
        raise InputError(f"{type(lm).__name__} has no decoder layer list (<body>.layers) to shard", field="model")
    return list(layers)


class FSDPTrainer:
    """Policy trainer over an HF causal LM (same full weights on every rank when distributed).

    ``trainer.step(rollout, rewards)`` runs one update and returns metrics (floats, equal on all
    ranks). ``trainer.logprobs(rollout)`` is a no-grad recomputation, gathered to every rank.
    ``trainer.full_state_dict()`` gives rank 0 the full weights under HF names (LoRA merged),
    ready for a weight sync. Checkpoints: :mod:`.checkpoint`.
    """

    def __init__(self, model: torch.nn.Module, config: TrainerConfig | None = None, *, mesh=None):
        import torch.distributed as dist

        self.config = cfg = config or TrainerConfig()
        self._correction = _correction_fn(cfg.correction)
        self.rank, self.world_size = rank_and_world()
        if cfg.qat:
            model = _apply_qat(model, cfg.qat)
        self.lora_modules: list[str] = []
        if cfg.lora_rank:
            from .lora import apply_lora

            self.lora_modules = apply_lora(model, rank=cfg.lora_rank, alpha=cfg.lora_alpha, targets=cfg.lora_targets)
        self.policy = PolicyModel(model)
        self.keep_grads = False
        self.last_grads: dict = {}
        self.device = next(model.parameters()).device
        self.sharded = mesh is not None or self.world_size > 1
        if self.sharded:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            if mesh is None:
                mesh = init_device_mesh(self.device.type, (self.world_size,))
            for layer in _decoder_layers(model):
                fully_shard(layer, mesh=mesh, reshard_after_forward=cfg.reshard_after_forward)
            fully_shard(self.policy, mesh=mesh, reshard_after_forward=cfg.reshard_after_forward)
            self.world_size = mesh.size()
            self.rank = mesh.get_local_rank()
        self.mesh = mesh
        self._dist = self.sharded and dist.is_initialized()
        params = [p for p in self.policy.parameters() if p.requires_grad]
        if not params:
            raise InputError("the model has no trainable parameters", field="model")
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.adam_eps,
                                           weight_decay=cfg.weight_decay)
        self.global_step = 0

    # ---- helpers ----------------------------------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        """The wrapped HF model (sharded in place when distributed)."""
        return self.policy.lm

    def _context(self):
        return _batch_invariant_context() if self.config.batch_invariant else contextlib.nullcontext()

    def _temperature(self, rollout: Rollout) -> float:
        t = self.config.temperature
        return float(t if t is not None else (rollout.sampling.get("temperature", 1.0) or 1.0))

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self._dist:
            import torch.distributed as dist

            t = t.to(self.device)
            dist.all_reduce(t)
        return t.cpu()

    def local_rows(self, rollout: Rollout) -> np.ndarray:
        return shard_rows(len(rollout), self.world_size, self.rank)

    def micro_batches(self, rollout: Rollout, rows: np.ndarray):
        mbs = self.config.micro_batch_size
        routes = rollout.routes if self.config.route_replay else None
        if self.config.route_replay and routes is None:
            raise InputError("route_replay=True but the rollout has no routes", field="routes")
        for s in range(0, len(rows), mbs):
            yield make_micro_batch(rollout, rows[s:s + mbs], pad_id=self.config.pad_id,
                                   use_support=self.config.use_support, routes=routes)

    def _run(self, mb, rollout, *, with_entropy=True):
        return self.policy.run(mb, routes=rollout.routes if self.config.route_replay else None,
                               temperature=self._temperature(rollout), token_chunk=self.config.token_chunk,
                               with_entropy=with_entropy)

    # ---- no-grad logprobs -------------------------------------------------------------------
    @torch.no_grad()
    def logprobs(self, rollout: Rollout, *, local_only: bool = False) -> np.ndarray:
        """float32 ``[Σ response_len]`` trainer logprobs of ``rollout`` (no grad).

        Each rank computes its rows; ``local_only=False`` sums the disjoint pieces over ranks
        (exact: the other positions are zeros), so every rank gets the whole array.
        """
        out = torch.zeros(rollout.num_response_tokens, dtype=torch.float32)
        with self._context():
            for mb in self.micro_batches(rollout, self.local_rows(rollout)):
                lp, _ = self._run(mb, rollout, with_entropy=False)
                out[torch.from_numpy(mb.token_index)] = lp.float().cpu()
        if not local_only:
            out = self._all_reduce(out)
        return out.numpy()

    # ---- the update -------------------------------------------------------------------------
    def step(self, rollout: Rollout, rewards, *, old_logprobs=None) -> dict:
        """One policy update on ``rollout`` with per-sequence ``rewards`` [B]; returns metrics.

        ``old_logprobs``: flat ``[Σ response_len]`` log π_old (e.g. :meth:`logprobs` before the
        first of several updates on the same batch); default: see the module doc, step 3.
        """
        cfg = self.config
        rewards = np.asarray(rewards, dtype=np.float64).reshape(-1)
        if rewards.shape != (len(rollout),):
            raise InputError(f"expected {len(rollout)} rewards (one per sequence), got shape {rewards.shape}",
                             field="rewards")
        if len(rollout) < self.world_size:  # checked on every rank alike, before any collective
            raise InputError(f"the batch has {len(rollout)} sequences for {self.world_size} ranks; every rank "
                             "needs at least one", field="rows")
        kw = {"std_normalize": cfg.std_normalize, "eps": cfg.adv_eps} if cfg.advantage == "grpo" else {}
        seq_adv = compute_advantages(cfg.advantage, torch.from_numpy(rewards), rollout.group_ids, **kw)
        adv = token_advantages(seq_adv.float(), rollout.response_cu)
        rows = self.local_rows(rollout)
        mbs = list(self.micro_batches(rollout, rows)) if len(rows) else []
        rollout_lp = torch.from_numpy(rollout.rollout_logprobs)

        # log π_old, correction and keep mask per micro-batch; the global denominator
        old_all = resolve_old_logprobs(rollout, old_logprobs, self._correction is not None,
                                       lambda: self.logprobs(rollout, local_only=True))
        per_mb, corr_metrics, n_corr_tokens = correct_micro_batches(mbs, self._correction, old_all,
                                                                    rollout_lp)
        kept_tok, kept_seq = kept_totals(per_mb)
        totals = self._all_reduce(torch.tensor([kept_tok, kept_seq], dtype=torch.float64))
        denom = float(totals[0] if cfg.aggregation == "token_mean" else totals[1])

        # forward / backward per micro-batch
        stats = torch.zeros(8, dtype=torch.float64)  # loss, low, high, ratio, ent, ppo_kl, n, ratio_max
        stats[7] = -math.inf
        self.optimizer.zero_grad(set_to_none=True)
        last = len(per_mb) - 1
        with self._context():
            for j, (mb, ti, w, keep) in enumerate(per_mb):
                if self.sharded:
                    self.policy.set_requires_gradient_sync(j == last)
                lp, ent = self._run(mb, rollout)
                old = lp.detach() if old_all is None else old_all[ti].to(lp.device)
                dev = lp.device
                pl = ppo_clip_loss(lp, old, adv[ti].to(dev), mask=None if keep is None else keep.to(dev),
                                   weights=None if w is None else w.to(dev), eps_low=cfg.eps_low,
                                   eps_high=cfg.eps_high, dual_clip=cfg.dual_clip, aggregation=cfg.aggregation,
                                   cu_seqlens=mb.cu_seqlens, denominator=denom)
                (pl.loss * self.world_size).backward()
                m, n = pl.metrics, pl.metrics["n_tokens"]
                if n:  # metrics are means over kept tokens: carry them as sums
                    ent_mean = float(masked_mean(ent.detach(), None if keep is None else keep.to(dev)))
                    stats[:7] += torch.tensor([pl.loss.item(), m["clipfrac_low"] * n, m["clipfrac_high"] * n,
                                               m["ratio_mean"] * n, ent_mean * n, m["ppo_kl"] * n, n],
                                              dtype=torch.float64)
                    stats[7] = max(float(stats[7]), m["ratio_max"])
        ratio_max = stats[7].clone()
        stats[7] = 0.0
        stats = self._all_reduce(stats)
        if self._dist:
            import torch.distributed as dist

            rm = ratio_max.to(self.device)
            dist.all_reduce(rm, op=dist.ReduceOp.MAX)
            ratio_max = rm.cpu()
        if self.keep_grads:   # the step's gradient before clipping, e.g. to compare directions
            self.last_grads = {n.removeprefix("lm."): p.grad.detach().float().clone()
                               for n, p in self.policy.named_parameters() if p.grad is not None}
        grad_norm = self._clip()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1

        n = float(stats[6])
        div = (lambda x: float(x) / n) if n else (lambda x: math.nan)
        out = {"loss": float(stats[0]), "clipfrac_low": div(stats[1]), "clipfrac_high": div(stats[2]),
               "clipfrac": div(stats[1] + stats[2]), "ratio_mean": div(stats[3]), "ratio_max": float(ratio_max),
               "entropy": div(stats[4]), "ppo_kl": div(stats[5]), "n_tokens": n, "grad_norm": grad_norm,
               "adv_mean": float(seq_adv.mean()), "reward_mean": float(rewards.mean()), "step": self.global_step}
        if corr_metrics or self._correction is not None:
            keys = sorted(corr_metrics)
            vec = self._all_reduce(torch.tensor([corr_metrics[k] for k in keys] + [n_corr_tokens],
                                                dtype=torch.float64))
            tot = float(vec[-1])
            out.update({f"correction/{k}": float(v) / tot if tot else math.nan for k, v in zip(keys, vec[:-1])})
        return out

    def _clip(self) -> float:
        params = [p for p in self.policy.parameters() if p.grad is not None]
        if not params:
            return 0.0
        max_norm = self.config.grad_clip if self.config.grad_clip is not None else math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    # ---- weights ----------------------------------------------------------------------------
    def state_dict(self, *, full: bool = True) -> dict:
        """Trainer-named weights (prefix ``lm.`` stripped). ``full``: gathered to rank 0 on CPU
        (other ranks get ``{}``), else this rank's shards (DTensors)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if not self.sharded:
            sd = {k: v.detach().cpu().clone() for k, v in self.policy.state_dict().items()}
        else:
            sd = get_model_state_dict(self.policy, options=StateDictOptions(full_state_dict=full,
                                                                            cpu_offload=full))
        return {k.removeprefix("lm."): v for k, v in sd.items()}

    def full_state_dict(self) -> dict:
        """HF-named full weights on rank 0 with LoRA adapters merged (``{}`` on other ranks)."""
        sd = self.state_dict(full=True)
        if self.lora_modules and sd:
            from .lora import merge_lora_state_dict

            sd = merge_lora_state_dict(sd)
        return sd

    def save(self, path) -> None:
        """Checkpoint weights + optimizer state (collective; see :mod:`.checkpoint`)."""
        from .checkpoint import save_checkpoint

        save_checkpoint(self, path)

    def load(self, path) -> dict:
        """Restore a checkpoint written by :meth:`save` (any world size); returns its trainer_state."""
        from .checkpoint import load_checkpoint

        return load_checkpoint(self, path)
