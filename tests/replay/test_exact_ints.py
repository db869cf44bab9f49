"""Replay inputs that are ids, lengths or indices are refused, naming the field, when they are
not whole numbers: they used to be truncated silently (a length 2.7 read as 2, a token id 1.9
as 1, a route row 0.6 as row 0), and a logprob above 0 was kept in a support."""
import numpy as np
import pytest
import torch

from skyrl_numerics.errors import InputError
from skyrl_numerics.replay import PackedRoutes, PackedSupport, support_logprobs


@pytest.mark.parametrize("call,field", [
    (lambda: PackedRoutes.empty([2.7, 3.2], 2, 2, 8), "seq_lens"),
    (lambda: PackedRoutes.empty(np.array([True, False]), 2, 2, 8), "seq_lens"),
    (lambda: PackedRoutes.empty([2, 3], 2.5, 2, 8), "num_layers"),
    (lambda: PackedRoutes.empty([2, 3], 2, 2, 8.5), "num_experts"),
    (lambda: PackedRoutes.empty([2, 3], 2, 2, 8).seq(1.5), "seq"),
    (lambda: PackedSupport.from_sets([[1.7, 3.2]]), "support"),
    (lambda: PackedSupport.from_sets([["a"]]), "support"),
    (lambda: PackedSupport.from_sets([3]), "support"),
    (lambda: PackedSupport.full(-1, 10), "num_tokens"),
    (lambda: PackedSupport.from_sets([[1, 2]]).row(0.5), "support"),
    (lambda: PackedSupport.from_topk_logprobs([{1: -0.1, 2: 2.0}]), "logprobs"),
    (lambda: PackedSupport.from_topk_logprobs([{1: -0.1, 2: float("inf")}]), "logprobs"),
    (lambda: PackedSupport.from_topk_logprobs([{1.7: -0.1}]), "logprobs"),
    (lambda: PackedSupport.from_topk_logprobs([{1: "x"}]), "logprobs"),
    (lambda: PackedSupport.from_topk_logprobs([[1, 2]]), "logprobs"),
])
def test_non_integer_ids_lengths_and_indices_are_refused(call, field):
    with pytest.raises(InputError) as e:
        call()
    assert e.value.field == field, str(e.value)


def test_whole_floats_and_integer_types_still_work():
    r = PackedRoutes.empty(np.array([2.0, 3.0]), 2, 2, 8)
    assert r.seq_lens.tolist() == [2, 3] and r.seq(np.int64(1)).shape == (3, 2, 2)
    s = PackedSupport.from_sets([np.array([3, 1], np.int32), [2.0]])
    assert s.row(0).tolist() == [1, 3] and s.row(1).tolist() == [2]


def test_support_logprobs_refuses_fractional_targets():
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(3, 8, generator=g), torch.randn(16, 8, generator=g)
    sup = PackedSupport.from_sets([[1, 2], [1, 2], [1, 2]], 16)
    with pytest.raises(InputError) as e:
        support_logprobs(h, w, torch.tensor([1.9, 2.0, 1.0]), sup)
    assert e.value.field == "targets" and e.value.index == 0
    assert support_logprobs(h, w, torch.tensor([1, 2, 1]), sup)[0].shape == (3,)
