"""batch_invariant_mode() on unmodified HF models of every supported family (Qwen3-MoE,
DeepSeek-V3, Mixtral, a dense Llama), as a user's trainer runs them: right-padded batches; and on
TRL 1.16's own GRPO logprob and loss code.

* The trace, under ``strict=True``: every aten op the forward and backward reach is either one
  the mode overrides or one ``kernels/mode_watch.py`` lists as row-local with its reason (the
  per-element property of the listed pointwise ops is tested per op in ``test_cpu_isa.py``);
  anything else raises ``NotInvariant`` naming it. A new op (another transformers release,
  another family) fails here until it is routed or shown to be safe.
* TRL's ``GRPOTrainer._compute_loss`` (fused LM head, chunked logprobs, the GRPO loss) forward and
  backward on the tiny Qwen3-MoE, in a child process with ``frameworks/trl`` on its path
  (``trl_grpo_child.py``), bf16 autocast and fp32, strict: nothing uncovered (before: its
  backward's ``acc.addmm_`` ran stock), and each sequence's logprobs alone equal its rows in the
  padded batch.
* Each of 7 sequences alone and inside a right-padded batch of all 7: the same logprob bits and
  the same input-embedding gradient bits (fp32 and bf16; SDPA and eager attention).
"""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from framework_paths import framework_dir
from skyrl_numerics.kernels import batch_invariant_mode, mode, mode_watch

pytestmark = pytest.mark.slow
CHILD = Path(__file__).with_name("trl_grpo_child.py")

FAMILIES = ("qwen3_moe", "deepseek_v3", "mixtral", "llama")
LENS = [9, 13, 5, 11, 7, 15, 3]


def _model(family: str, dtype: torch.dtype, attn: str):
    if family == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64)
        m = LlamaForCausalLM(cfg)
    else:
        from skyrl_numerics.models import build_tiny_model, load_hf_model

        m = load_hf_model(build_tiny_model(family), dtype="float32")
    m = m.to(dtype)
    m.config._attn_implementation = attn
    return m.train()


class _Trace(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.removeprefix("aten::")
        self.ops[name if func._overloadname == "default" else f"{name}.{func._overloadname}"] += 1
        return func(*args, **(kwargs or {}))


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 500, (len(LENS), max(LENS)), generator=g)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(LENS):
        mask[i, :n] = 1
    return ids, mask


def _logprobs_and_grads(m, ids, mask):
    """Per-token logprobs of the next token and d(sum of real logprobs)/d(input embeddings)."""
    emb = m.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = m(inputs_embeds=emb, attention_mask=mask).logits
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    lp = lp * mask[:, 1:]
    lp.sum().backward()
    return lp.detach(), emb.grad


@pytest.mark.parametrize("family", FAMILIES)
def test_every_op_reached_is_overridden_or_listed_row_local(family):
    claimed = set(mode.registered_ops("cpu"))
    seen = set()
    for dtype in (torch.float32, torch.bfloat16):
        for attn in ("sdpa", "eager"):
            m = _model(family, dtype, attn)
            ids, mask = _batch()
            with batch_invariant_mode(strict=True), _Trace() as t:
                _logprobs_and_grads(m, ids[:3], mask[:3])
            seen |= set(t.ops)
    assert {op for op in seen - claimed if not mode_watch.allowed(op.split(".")[0])} == set()
    assert "mm" in seen and "_log_softmax" in seen     # (the trace does see the mode's ops)


def test_trl_grpo_logprobs_and_loss_backward_are_covered_and_invariant():
    """TRL's GRPO loss forward + backward under the strict mode, in a child (module doc)."""
    env = dict(os.environ)      # as tests/integrations/conftest.py's trl_env: frameworks/trl first
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(framework_dir("trl")), env.get("PYTHONPATH")) if p)
    res = subprocess.run([sys.executable, str(CHILD)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["ok"], f"strict mode named {out.get('op')}: {out.get('error')}"
    for run in ("bf16_autocast", "fp32"):
        r = out[run]
        assert r["params_with_grad"] > 0 and r["finite"] and r["rows_differing"] == 0, (run, r)


@pytest.mark.isa
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_rows_of_a_right_padded_batch_equal_each_sequence_alone(family, attn, dtype):
    m = _model(family, dtype, attn)
    ids, mask = _batch()
    with batch_invariant_mode(strict=True):
        lp, grad = _logprobs_and_grads(m, ids, mask)
        for i, n in enumerate(LENS):
            lp1, grad1 = _logprobs_and_grads(m, ids[i:i + 1, :n], mask[i:i + 1, :n])
            assert torch.equal(lp[i, :n - 1], lp1[0]), f"sequence {i}: logprobs"
            assert torch.equal(grad[i, :n], grad1[0]), f"sequence {i}: input-embedding gradient"
    assert lp.abs().sum() > 0 and grad.abs().sum() > 0
