"""The megatron-core policy forward: a rollout micro-batch -> response-token logprobs / entropy, with gradient.

The same micro-batches as the FSDP trainer (:func:`skyrl_numerics.trainer.fsdp.forward.make_micro_batch`:
right-padded ``p ++ r`` rows, the logprob of ``r[t]`` read at position ``P + t - 1``), run through the real
``GPTModel.forward`` (embedding, RoPE, decoder with MoE layers, final norm). The lm-head is not run by the
model: ``post_process`` is switched off for the call so ``GPTModel.forward`` returns the final-norm hidden
states, and the logprobs come from :func:`~.vocab_parallel.vocab_parallel_logprobs` over this rank's lm-head
shard (no ``[tokens, vocab]`` logits, no vocabulary gather).

With sequence parallelism the decoder output is split along the sequence over the TP ranks; it is
all-gathered with megatron-core's ``gather_from_sequence_parallel_region`` (its backward reduce-scatter
sums the TP ranks' partial hidden-state gradients). The padded width is rounded up to a multiple of TP.

R3: ``routes`` (the rollout's PackedRoutes) are replayed in every TopKRouter through megatron-core's
RouterReplay (:func:`skyrl_numerics.replay.megatron.megatron_route_replay`), inside ``GPTModel.forward``.
Positions the routes do not cover (padding, the last sampled token) get the filler described there: they
feed no logprob that is read.
"""
from __future__ import annotations

import contextlib

import torch

__all__ = ["MegatronPolicy"]


def _rows_routes(routes, rows):
    from skyrl_numerics.replay import PackedRoutes

    return PackedRoutes.from_sequences([routes.seq(int(i)) for i in rows], routes.num_experts)


class MegatronPolicy:
    """``MegatronPolicy(gpt_model, vocab_size)``: ``run(mb, ...) -> (logprobs [n], entropy [n] or None)``."""

    def __init__(self, model, vocab_size: int):
        from megatron.core import parallel_state as ps

        self.model = model
        self.vocab_size = int(vocab_size)
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.tp_group = ps.get_tensor_model_parallel_group() if self.tp > 1 else None
        self.sequence_parallel = bool(model.config.sequence_parallel)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.output_layer.weight

    def hidden(self, input_ids: torch.Tensor, *, routes=None, rows=None) -> torch.Tensor:
        """Final-norm hidden states ``[b, S', H]`` (S' = S rounded up to a multiple of TP), full on every TP rank."""
        b, S = input_ids.shape
        dev = next(self.model.parameters()).device  # (not .weight: a parametrized read may be a collective)
        input_ids = input_ids.to(dev)
        Sp = -(-S // self.tp) * self.tp
        if Sp != S:
            input_ids = torch.cat([input_ids, input_ids.new_zeros(b, Sp - S)], dim=1)
        pos = torch.arange(Sp, dtype=torch.long, device=dev)[None].expand(b, Sp)
        ctx = contextlib.nullcontext()
        if routes is not None:
            from skyrl_numerics.replay.megatron import megatron_route_replay

            sub = _rows_routes(routes, rows)
            ctx = megatron_route_replay(sub, seq_len=Sp, tp_rank=self.tp_rank if self.sequence_parallel else 0,
                                        tp_size=self.tp if self.sequence_parallel else 1, device=dev)
        from .compat import cpu_compat

        m = self.model
        saved = m.post_process
        m.post_process = False  # GPTModel.forward returns the decoder's (final-norm) output
        with cpu_compat():  # megatron-core code runs here; its backward must run under it too (step() does)
            try:
                with ctx:
                    h = m(input_ids, pos, attention_mask=None)  # [S'/tp or S', b, H]
            finally:
                m.post_process = saved
            if self.sequence_parallel:
                from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

                h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True)
            elif self.tp > 1:
                from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

                h = copy_to_tensor_model_parallel_region(h)
        return h.transpose(0, 1)

    def run(self, mb, *, routes=None, temperature: float = 1.0, token_chunk: int = 8192, with_entropy: bool = True):
        """Forward one FSDP-style :class:`~skyrl_numerics.trainer.fsdp.forward.MicroBatch`."""
        from .vocab_parallel import vocab_parallel_logprobs

        hidden = self.hidden(mb.input_ids, routes=routes, rows=mb.rows)
        dev = hidden.device
        h = hidden[mb.pos_b.to(dev), mb.pos_t.to(dev)].float()
        if temperature != 1.0:
            h = h / temperature
        w = self.lm_head_weight
        lp, ent = vocab_parallel_logprobs(h, w, mb.targets.to(dev), vocab_start=self.tp_rank * w.shape[0],
                                          vocab_size=self.vocab_size, group=self.tp_group, support=mb.support,
                                          chunk=token_chunk)
        return lp, (ent if with_entropy else None)

    def parameters(self):
        return self.model.parameters()
