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
4. the correction (``config.correction``, e.g. ``"token_tis"`` with ``correction_kwargs={"cap": 2}``)
   on ``(log π_old, log π_rollout)`` gives weights ``w`` and keep mask ``m`` per rank (sequences
   are never split, so sequence-level masks see whole sequences);
5. the global denominator ``D`` (kept tokens, or kept sequences) is all-reduced, then each
   micro-batch backpropagates ``world · Σ_mb m w ℓ / D``; FSDP's gradient averaging over ranks
   divides the ``world`` back out, so the summed gradient is that of the full-batch loss;
6. gradient-norm clip, AdamW step.

The configuration is :class:`~skyrl_numerics.trainer.config.TrainerConfig`. The forward is
switchable: ``batch_invariant`` (``skyrl_numerics.kernels.batch_invariant_mode`` around forward
and backward), ``use_support`` (top-p/top-k support replay), ``route_replay`` (R3),
``qat`` (``skyrl_numerics.quant.apply_qat(model, recipe)`` before sharding), LoRA.
"""
from __future__ import annotations

import contextlib
import math
import numpy as np
import torch

from skyrl_numerics.errors import InputError
from skyrl_numerics.rollout import Rollout

from ..config import TrainerConfig
from ..dist import rank_and_world, shard_rows
from .forward import PolicyModel, make_micro_batch
from ..ppo_step import ppo_update

__all__ = ["FSDPTrainer"]


def batch_invariant_context():
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
        from skyrl_numerics.engine.serving_checkpoint import qat_rules

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
        self._correction = cfg.correction_callable()
        self.rank, self.world_size = rank_and_world()
        if cfg.qat:
            model = _apply_qat(model, cfg.qat)
        self.lora_modules: list[str] = []
        if cfg.lora_rank:
            from .lora import apply_lora

            self.lora_modules = apply_lora(model, rank=cfg.lora_rank, alpha=cfg.lora_alpha, patterns=cfg.lora_patterns)
            if cfg.qat:      # the frozen base's QAT weights: quantized once, not on every forward
                from skyrl_numerics.quant.qat import bake_frozen

                bake_frozen(model)
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
        return batch_invariant_context() if self.config.batch_invariant else contextlib.nullcontext()

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
        """One policy update on ``rollout`` with per-sequence ``rewards`` [B]; returns metrics
        (:func:`..ppo_step.ppo_update`: this trainer gives its micro-batches, forward and the
        all-reduces over its ranks).

        ``old_logprobs``: flat ``[Σ response_len]`` log π_old (e.g. :meth:`logprobs` before the
        first of several updates on the same batch); default: see the module doc, step 3.
        """
        if len(rollout) < self.world_size:  # checked on every rank alike, before any collective
            raise InputError(f"the batch has {len(rollout)} sequences for {self.world_size} ranks; every rank "
                             "needs at least one", field="rows")
        rows = self.local_rows(rollout)
        self.optimizer.zero_grad(set_to_none=True)

        def before(j: int, last: bool) -> None:
            if self.sharded:
                self.policy.set_requires_gradient_sync(last)

        return ppo_update(rollout, rewards, self.config, correction=self._correction,
                          micro_batches=self.micro_batches(rollout, rows) if len(rows) else [],
                          forward=lambda mb: self._run(mb, rollout), update=self._update,
                          old_logprobs=old_logprobs,
                          recompute_old=lambda: self.logprobs(rollout, local_only=True),
                          reduce_sum=self._all_reduce, reduce_max=self._all_reduce_max,
                          loss_scale=self.world_size, before_micro_batch=before, context=self._context)

    def _all_reduce_max(self, x: float) -> float:
        if not self._dist:
            return float(x)
        import torch.distributed as dist

        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.cpu()[0])

    def _update(self) -> tuple[float, int]:
        if self.keep_grads:   # the step's gradient before clipping, e.g. to compare directions
            self.last_grads = {n.removeprefix("lm."): p.grad.detach().float().clone()
                               for n, p in self.policy.named_parameters() if p.grad is not None}
        grad_norm = self._clip()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        return grad_norm, self.global_step

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
