"""DSA indexer capture's engine-side parts without an engine: the refusals before vLLM starts
(``capture_index`` names the field) and the per-layer assembly of the request groups' choices
in token order (``vllm_invariant_model.IndexRows``). The captured choices themselves:
tests/e2e/test_deepseek_v32_vllm.py."""
from __future__ import annotations

import pytest
import torch

from skyrl_numerics.errors import InputError


@pytest.mark.parametrize("family,invariant", [("deepseek_v32", False), ("qwen3_moe", True)])
def test_capture_index_is_refused_before_the_engine_starts(family, invariant):
    pytest.importorskip("vllm")
    from skyrl_numerics.engine.generator import VLLMGenerator
    from skyrl_numerics.models import build_tiny_model

    with pytest.raises(InputError) as e:
        VLLMGenerator(build_tiny_model(family), batch_invariant=invariant, capture_index=True)
    assert e.value.field == "capture_index"
    assert ("batch_invariant=True" if not invariant else "no DSA indexer") in str(e.value)


def test_group_choices_land_at_their_tokens():
    from skyrl_numerics.engine.vllm_invariant_model import IndexRows

    rows = IndexRows(torch.zeros((5, 4), dtype=torch.int64))
    rows.put(torch.tensor([1, 3]), torch.tensor([[0, 1, 2, 3], [0, 2, 4, 6]]))
    rows.put(torch.tensor([0, 2, 4]), torch.tensor([[0, 1], [0, 0], [1, 0]]))  # 2 keys: K < topk
    assert rows.rows.tolist() == [[0, 1, 0, 0], [0, 1, 2, 3], [0, 0, 0, 0], [0, 2, 4, 6],
                                  [1, 0, 0, 0]]
