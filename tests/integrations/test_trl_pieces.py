"""The TRL adapter's pieces without TRL (``integrations.trl``): the positions the shim adds and when
it adds none, the hook's removal, ``invariant``'s undo, and ``apply_to_batch``'s refusals. TRL's own
code drives them in ``test_trl_grpo.py`` and ``test_trl_correction.py``."""
from __future__ import annotations

import pytest
import torch

from skyrl_numerics import correction as C
from skyrl_numerics.errors import InputError
from skyrl_numerics.integrations.trl import add_position_ids, apply_to_batch, invariant, positions_from_mask
from skyrl_numerics.kernels import is_batch_invariant_mode_enabled


class Seen(torch.nn.Module):
    """Records the keyword arguments of its last call."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, **kw):
        self.kw = {"position_ids": position_ids}
        return input_ids


def test_positions_count_attended_tokens_and_padding_reads_one():
    m = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    assert positions_from_mask(m).tolist() == [[1, 1, 0, 1, 2, 1], [0, 1, 2, 3, 4, 5]]


def test_the_hook_adds_positions_only_where_they_are_missing_and_comes_off():
    model, ids = Seen(), torch.ones(2, 4, dtype=torch.long)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    h = add_position_ids(model)
    model(input_ids=ids, attention_mask=mask)
    assert model.kw["position_ids"].tolist() == [[1, 0, 1, 2], [0, 1, 2, 3]]
    given = torch.zeros(2, 4, dtype=torch.long)
    model(input_ids=ids, attention_mask=mask, position_ids=given)
    assert model.kw["position_ids"] is given
    model(input_ids=ids[:, -1:], attention_mask=mask)                  # decode step: mask is longer
    assert model.kw["position_ids"] is None
    model(input_ids=ids, attention_mask=mask, past_key_values=object())
    assert model.kw["position_ids"] is None
    h.remove()
    model(input_ids=ids, attention_mask=mask)
    assert model.kw["position_ids"] is None
    with pytest.raises(InputError) as e:
        add_position_ids(lambda **kw: None)
    assert e.value.field == "model"


def test_invariant_undoes_the_hook_and_the_mode():
    class T:
        model, ref_model = Seen(), None
    assert not is_batch_invariant_mode_enabled()
    with invariant(T, strict=True):
        assert len(T.model._forward_pre_hooks) == 1 and is_batch_invariant_mode_enabled()
    assert len(T.model._forward_pre_hooks) == 0 and not is_batch_invariant_mode_enabled()


def test_apply_to_batch_refuses_a_batch_without_trls_is_tensors():
    batch = {"completion_mask": torch.ones(1, 3, dtype=torch.long), "old_per_token_logps": torch.zeros(1, 3)}
    with pytest.raises(InputError) as e:
        apply_to_batch(None, batch, lambda a, b, m: C.token_tis(a, b, m))
    assert e.value.field == "sampling_per_token_logps"
    batch["sampling_per_token_logps"] = torch.zeros(1, 3)
    with pytest.raises(InputError) as e:
        apply_to_batch(None, batch, lambda a, b, m: "weights")
    assert e.value.field == "make" and "importance_sampling_ratio" not in batch
