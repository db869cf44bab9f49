"""MegatronTrainer: one PPO/GRPO update per :meth:`MegatronTrainer.step` over a megatron-core GPTModel (MoE),
tensor parallel ``tp`` x expert parallel ``ep`` on ``max(tp, ep)`` ranks (gloo on CPU, NCCL on GPU).

The same :class:`~skyrl_numerics.trainer.config.TrainerConfig`, the same micro-batches and the same
losses (:mod:`skyrl_numerics.trainer.losses`) as :class:`~skyrl_numerics.trainer.fsdp.trainer.FSDPTrainer`;
what differs is the model and its parallelism:

- weights come from the HF checkpoint through :mod:`.mapping` (every rank loads its shard);
- every rank runs every micro-batch (all ranks are model-parallel: no data parallelism), so the loss, the
  logprobs and every metric are the same on all ranks;
- the lm-head is vocab-parallel (:mod:`.vocab_parallel`): logprobs, entropy and the support replay never
  gather the vocabulary;
- after backward, the gradients of weights every TP rank holds whole (norms, q/k norms, router) are
  all-reduced over the TP group: under sequence parallelism each rank's covers its own tokens (and a q/k
  norm's its own heads); the gradient norm for clipping sums TP shards over the TP group and experts over
  the EP group, counting replicated weights once; AdamW then runs on each rank's shards (elementwise);
- alignment pieces: ``use_support`` (support replay, vocab-parallel), ``route_replay`` (R3 through
  megatron-core's RouterReplay inside ``GPTModel.forward``), ``qat`` (:func:`.qat.apply_megatron_qat`:
  a recipe name wraps the experts, as the serving checkpoint quantizes them), ``batch_invariant``
  (``kernels.batch_invariant_mode()`` around forward and backward: megatron-core's forward then gives
  bitwise the same logprobs at every micro-batch size, tested). LoRA is refused (not implemented here).

On CPU the compatibility module (:mod:`.compat`) is installed around each call into megatron-core
(construction, :meth:`step`, :meth:`logprobs`), not for the trainer's lifetime. Without a process group (one process) the trainer makes a 1-rank gloo group of
its own.
"""
from __future__ import annotations

import math
import os
import tempfile

import numpy as np
import torch

from skyrl_numerics.errors import InputError
from skyrl_numerics.rollout import Rollout

from ..config import TrainerConfig
from ..fsdp.trainer import batch_invariant_context
from ..ppo_step import ppo_update

__all__ = ["MegatronTrainer", "spawn_megatron"]


def _scoped(fn):
    """Run ``fn`` with the CPU compatibility installed (nothing with CUDA)."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from .compat import cpu_compat

        with cpu_compat():
            return fn(*args, **kwargs)

    return wrapper


def _hf_state(model) -> tuple[dict, dict]:
    """(config dict, checkpoint-named state dict) of an HF model or a model directory."""
    from .model import hf_config_dict

    if isinstance(model, (str, os.PathLike)):
        from safetensors.torch import load_file

        cfg = hf_config_dict(model)
        path = os.path.join(str(model), "model.safetensors")
        if not os.path.isfile(path):
            raise InputError(f"{path}: no such file", field="model")
        return cfg, load_file(path)
    if not hasattr(model, "config"):
        raise InputError(f"expected an HF causal LM or a model directory, got {type(model).__name__}", field="model")
    from skyrl_numerics.engine.weight_update import checkpoint_state_dict

    return hf_config_dict(model.config), {k: v.detach() for k, v in checkpoint_state_dict(model).items()}


def spawn_megatron(fn, config, *args, tp: int = 1, ep: int = 1, timeout: float | None = None, **kw) -> None:
    """Check the layout against the model ``config`` (InputError, no process started), then run
    ``fn(rank, world_size, *args)`` on ``max(tp, ep)`` gloo/NCCL ranks (:func:`skyrl_numerics.trainer.dist.spawn`)."""
    from ..dist import spawn
    from .model import check_parallel_config

    check_parallel_config(config, tp, ep)
    spawn(fn, max(tp, ep), *args, timeout=timeout, **kw)


class MegatronTrainer:
    """Policy trainer over megatron-core. ``MegatronTrainer(hf_model_or_dir, TrainerConfig(...), tp=, ep=)``.

    ``step(rollout, rewards)`` / ``logprobs(rollout)`` as :class:`FSDPTrainer`; ``full_state_dict()`` gives
    every rank the full weights under HF checkpoint names (what a weight sync sends), gathered from the
    shards.
    """

    @_scoped
    def __init__(self, model, config: TrainerConfig | None = None, *, tp: int = 1, ep: int = 1,
                 dtype: torch.dtype = torch.float32, grouped_experts: bool = False, seed: int = 0):
        import torch.distributed as dist

        from .forward import MegatronPolicy
        from .mapping import hf_to_megatron, shard_for_rank
        from .model import build_gpt_model, check_parallel_config, init_parallel, load_weights

        self.config = cfg = config or TrainerConfig()
        if cfg.lora_rank:
            raise InputError("LoRA is not implemented for the megatron trainer", field="lora_rank")
        hf_cfg, hf_sd = _hf_state(model)
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.hf_config = check_parallel_config(hf_cfg, tp, ep, world_size=world)  # before any group / model
        self._correction = cfg.correction_callable()
        self.tp, self.ep = tp, ep
        self._own_group = None
        if not dist.is_initialized():
            self._own_group = tempfile.mkdtemp(prefix="skyrl_mcore_")
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                    init_method=f"file://{self._own_group}/store", rank=0, world_size=1)
        init_parallel(tp, ep, seed=seed)
        from megatron.core import parallel_state as ps

        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.tp_rank, self.ep_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.ep_group = ps.get_expert_model_parallel_group()
        self.grouped_experts = grouped_experts
        self.gpt = build_gpt_model(self.hf_config, tp=tp, ep=ep, dtype=dtype, grouped_experts=grouped_experts,
                                   route_replay=cfg.route_replay)
        full = hf_to_megatron({k: v.to(dtype) for k, v in hf_sd.items()}, self.hf_config,
                              grouped_experts=grouped_experts)
        load_weights(self.gpt, shard_for_rank(full, self.hf_config, tp_rank=self.tp_rank, tp=tp,
                                              ep_rank=self.ep_rank, ep=ep))
        if torch.cuda.is_available():  # built on the CPU (use_cpu_initialization); GPU path not tested here
            self.gpt.cuda()
        del full, hf_sd
        self.qat_wrapped = {}
        if cfg.qat:
            from .qat import apply_megatron_qat

            rules = cfg.qat
            if isinstance(rules, str):
                from skyrl_numerics.engine.serving_checkpoint import qat_rules

                rules = qat_rules(rules)
            self.qat_wrapped = apply_megatron_qat(self.gpt, rules)
        self.policy = MegatronPolicy(self.gpt, self.hf_config["vocab_size"])
        params = [p for p in self.gpt.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.adam_eps,
                                           weight_decay=cfg.weight_decay)
        self.global_step = 0
        self.keep_grads = False
        self.last_grads: dict = {}

    # ---- helpers ----------------------------------------------------------------------------
    def close(self) -> None:
        """Destroy megatron's groups (and the trainer's own 1-rank group, if it made one)."""
        import torch.distributed as dist

        from .model import destroy_parallel

        destroy_parallel()
        if self._own_group is not None and dist.is_initialized():
            dist.destroy_process_group()
            self._own_group = None

    def _context(self):
        import contextlib

        return batch_invariant_context() if self.config.batch_invariant else contextlib.nullcontext()

    def _temperature(self, rollout: Rollout) -> float:
        t = self.config.temperature
        return float(t if t is not None else (rollout.sampling.get("temperature", 1.0) or 1.0))

    def micro_batches(self, rollout: Rollout):
        from ..fsdp.forward import make_micro_batch

        if self.config.route_replay and rollout.routes is None:
            raise InputError("route_replay=True but the rollout has no routes", field="routes")
        rows = np.arange(len(rollout))
        mbs = self.config.micro_batch_size
        for s in range(0, len(rows), mbs):
            yield make_micro_batch(rollout, rows[s:s + mbs], pad_id=self.config.pad_id,
                                   use_support=self.config.use_support)

    def _run(self, mb, rollout, *, with_entropy=True):
        self.gpt.train(torch.is_grad_enabled())
        return self.policy.run(mb, routes=rollout.routes if self.config.route_replay else None,
                               temperature=self._temperature(rollout), token_chunk=max(self.config.token_chunk, 1),
                               with_entropy=with_entropy)

    # ---- no-grad logprobs -------------------------------------------------------------------
    @_scoped
    @torch.no_grad()
    def logprobs(self, rollout: Rollout) -> np.ndarray:
        """float32 ``[Σ response_len]`` trainer logprobs (no grad), the same on every rank."""
        out = torch.zeros(rollout.num_response_tokens, dtype=torch.float32)
        with self._context():
            for mb in self.micro_batches(rollout):
                lp, _ = self._run(mb, rollout, with_entropy=False)
                out[torch.from_numpy(mb.token_index)] = lp.float().cpu()
        return out.numpy()

    # ---- gradients --------------------------------------------------------------------------
    def _finalize_grads(self) -> float:
        """Sum the gradients of weights that several ranks hold whole; return the global gradient norm.

        Non-expert weights that are not TP shards (norms, q/k norms, router) are whole on every TP rank and
        each rank's gradient covers its tokens (sequence parallel) or heads: all-reduce over the TP group.
        Expert weights are whole on every rank of their expert-data-parallel group (``world / ep`` ranks):
        all-reduce over it. With ``ep > tp`` there are ``world / tp`` data-parallel replicas that all run the
        same micro-batches, and every replica's tokens reach the experts: an expert's gradient is then
        ``world / tp`` times the batch's, and is divided back (exact for identical copies; the norm and AdamW
        see the batch gradient). The norm counts each weight once: replicated ones locally, TP shards summed
        over the TP group, experts summed over the EP group.
        """
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from .mapping import tp_dim

        edp = ps.get_expert_data_parallel_group()
        replicas = self.world_size // self.tp  # data-parallel copies of the same micro-batches
        sq_rep = sq_tp = sq_ep = 0.0
        for name, p in self.gpt.named_parameters():
            if p.grad is None:
                continue
            # by name: megatron sets ``tensor_model_parallel`` only when it initializes the weight itself
            name = name.replace("parametrizations.", "").replace(".original", "")
            if ".mlp.experts." in name:
                if dist.get_world_size(edp) > 1:
                    dist.all_reduce(p.grad, group=edp)
                if replicas > 1:
                    p.grad.div_(replicas)
                sq_ep += float(p.grad.double().square().sum())
            elif tp_dim(name) is not None and self.tp > 1:
                sq_tp += float(p.grad.double().square().sum())
            else:
                if self.tp > 1:
                    dist.all_reduce(p.grad, group=self.tp_group)
                sq_rep += float(p.grad.double().square().sum())
        t = torch.tensor([sq_tp], dtype=torch.float64)
        if self.tp > 1:
            dist.all_reduce(t, group=self.tp_group)
        e = torch.tensor([sq_ep], dtype=torch.float64)
        if self.ep > 1:
            dist.all_reduce(e, group=self.ep_group)
        return math.sqrt(sq_rep + float(t[0]) + float(e[0]))

    # ---- the update -------------------------------------------------------------------------
    @_scoped
    def step(self, rollout: Rollout, rewards, *, old_logprobs=None) -> dict:
        """One policy update on ``rollout`` with per-sequence ``rewards`` [B]; metrics as
        FSDPTrainer.step (:func:`..ppo_step.ppo_update`; every rank holds the whole batch, so
        nothing is all-reduced here: megatron-core reduces the gradients)."""
        self.optimizer.zero_grad(set_to_none=True)
        return ppo_update(rollout, rewards, self.config, correction=self._correction,
                          micro_batches=self.micro_batches(rollout),
                          forward=lambda mb: self._run(mb, rollout), update=self._update,
                          old_logprobs=old_logprobs, recompute_old=lambda: self.logprobs(rollout),
                          context=self._context)

    def _update(self) -> tuple[float, int]:
        cfg = self.config
        grad_norm = self._finalize_grads()
        if self.keep_grads:
            self.last_grads = {n: p.grad.detach().float().clone() for n, p in self.gpt.named_parameters()
                               if p.grad is not None}
        if cfg.grad_clip is not None and grad_norm > cfg.grad_clip:
            coef = cfg.grad_clip / (grad_norm + 1e-6)
            for p in self.gpt.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        return grad_norm, self.global_step

    # ---- weights ----------------------------------------------------------------------------
    def megatron_state_dict(self) -> dict:
        """This rank's megatron-core weights (plain names, full precision under QAT)."""
        from .qat import original_state_dict

        return original_state_dict(self.gpt)

    def full_state_dict(self, *, fused: bool = False) -> dict:
        """Collective: full HF weights on every rank, checkpoint names (``fused``: transformers>=5 memory names)."""
        from .mapping import gather_full, megatron_to_hf

        return megatron_to_hf(gather_full(self.megatron_state_dict(), self.hf_config), self.hf_config, fused=fused)

    def hf_grads(self) -> dict:
        """Collective: the last step's gradient (``keep_grads=True``) as full tensors under HF checkpoint names."""
        from .mapping import gather_full, megatron_to_hf

        if not self.last_grads:
            raise InputError("no gradient kept: set keep_grads = True before step()", field="keep_grads")
        g = {k.replace("parametrizations.", "").replace(".original", ""): v for k, v in self.last_grads.items()}
        return megatron_to_hf(gather_full(g, self.hf_config), self.hf_config)
