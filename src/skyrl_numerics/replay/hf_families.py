"""Gate weights at given expert indices, per HF router family (transformers 5.x router modules).

In transformers 5 each MoE block calls a router module ``gate`` that returns
``(router_logits, top_k_weights, top_k_index)``; the experts module then only consumes weights + indices.
Replay keeps the router's logits (so it keeps its gradient), takes the indices from the recording and
recomputes the weights at those indices with the family's own formula below -- the same operations in the
same order as the router's forward, so replaying the indices a router chose reproduces its weights
bit for bit.

- softmax top-k (Qwen2/Qwen3-MoE, Qwen3-Next, OLMoE): ``w = softmax(logits, fp32)[idx]``; if ``norm_topk_prob``:
  ``w /= sum(w)``; cast to the logits dtype.
- Mixtral: ``w = softmax(logits.float())[idx] / sum(...)`` (always renormalized, stays fp32).
- GPT-OSS: ``w = softmax(logits[idx])`` over the chosen experts' logits only, in the logits dtype
  (the router's bias is already in the logits; ``idx`` in the router's top-k order).
- DeepSeek-V3 (``noaux_tc``), DeepSeek-V3.2, GLM-4.5/4.7 (``Glm4MoeTopkRouter``) and Nemotron 3
  (Nemotron-H's ``moe`` blocks, ``NemotronHTopkRouter``), the same router:
  ``s = sigmoid(logits)``; ``w = s[idx]``; if ``norm_topk_prob``:
  ``w /= sum(w) + 1e-20``; ``w *= routed_scaling_factor``. The ``e_score_correction_bias`` and the
  group limit only steer *which* experts are chosen, not their weights, so they drop out under replay;
  shared experts are outside the router and untouched.
"""
from __future__ import annotations

import torch


def softmax_topk_weights(router, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    w = probs.gather(1, idx)
    if router.norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype)


def mixtral_weights(router, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    probs = torch.nn.functional.softmax(logits.float(), dim=-1)
    w = probs.gather(1, idx)
    return w / w.sum(dim=-1, keepdim=True)


def gpt_oss_weights(router, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    top = logits.gather(1, idx)
    return torch.nn.functional.softmax(top, dim=1, dtype=top.dtype)


def deepseek_v3_weights(router, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    scores = logits.sigmoid()
    w = scores.gather(1, idx)
    if router.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * router.routed_scaling_factor


# router class name -> (weight function, attribute holding the expert count)
ROUTER_FAMILIES = {
    "Qwen3MoeTopKRouter": (softmax_topk_weights, "num_experts"),
    "Qwen2MoeTopKRouter": (softmax_topk_weights, "num_experts"),
    "Qwen3NextTopKRouter": (softmax_topk_weights, "num_experts"),
    "OlmoeTopKRouter": (softmax_topk_weights, "num_experts"),
    "MixtralTopKRouter": (mixtral_weights, "num_experts"),
    "GptOssTopKRouter": (gpt_oss_weights, "num_experts"),
    "DeepseekV3TopkRouter": (deepseek_v3_weights, "num_experts"),
    "DeepseekV32TopkRouter": (deepseek_v3_weights, "num_experts"),
    "Glm4MoeTopkRouter": (deepseek_v3_weights, "num_experts"),
    "NemotronHTopkRouter": (deepseek_v3_weights, "num_experts"),
}
