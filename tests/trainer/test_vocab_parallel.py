"""vocab_parallel_logprobs in one process against support_logprobs, the single-shard path.

Both run ``replay.support_lp``'s ``shard_stats`` / ``shard_grads``; the vocab-parallel path only combines the
shards' statistics. One partition is therefore bitwise the single shard (logprob, entropy and both
gradients); ``P`` partitions differ from it by the rounding of the split sums only, at the tolerances of
test_megatron_parallel.py. TP 2 over gloo equals ``partitions=2`` bitwise: test_megatron_parallel.py.
"""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from skyrl_numerics.errors import InputError
from skyrl_numerics.replay import PackedSupport, support_logprobs
from skyrl_numerics.trainer.megatron.vocab_parallel import vocab_parallel_logprobs

SPLIT_ATOL = 2e-6  # float32 logprob, split vocabulary vs one pass (test_megatron_parallel.py)


def _case(seed, n, V, with_support, dtype):
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    h = torch.randn(n, 16, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(V, 16, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    if not with_support:
        return h, w, torch.from_numpy(rng.integers(0, V, n)), None
    sets = [rng.choice(V, size=int(rng.integers(1, V + 1)), replace=False) for _ in range(n)]
    targets = torch.tensor([int(rng.choice(s)) for s in sets])
    return h, w, targets, PackedSupport.from_sets(sets, V)


def _run(fn, h, w, targets, **kw):
    """``[logprob, entropy, d hidden, d weight]`` of ``logprob.sum() + 0.5 entropy.sum()``."""
    x, wr = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp, ent = fn(x, wr, targets, **kw)
    (lp.sum() + 0.5 * ent.sum()).backward()
    return [lp.detach(), ent.detach(), x.grad, wr.grad]


def _bits(t):
    return t.contiguous().view(torch.uint8)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2 ** 31), st.integers(1, 9), st.integers(1, 4), st.integers(1, 24), st.integers(1, 40),
       st.booleans(), st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_vocab_parallel_equals_single_shard(seed, n, partitions, vr, chunk, with_support, dtype):
    h, w, targets, support = _case(seed, n, partitions * vr, with_support, dtype)
    one = _run(support_logprobs, h, w, targets, support=support, chunk=chunk, method="dense")
    vp1 = _run(vocab_parallel_logprobs, h, w, targets, support=support, chunk=chunk)
    for a, b in zip(one, vp1):  # one partition: the same shard_stats / shard_grads calls, bit for bit
        assert a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))
    split = _run(vocab_parallel_logprobs, h, w, targets, support=support, chunk=chunk, partitions=partitions)
    tol = 1e-12 if dtype == torch.float64 else SPLIT_ATOL
    assert (split[0] - one[0]).abs().max() <= tol * 4
    assert (split[1] - one[1]).abs().max() <= tol * 10
    for a, b in zip(split[2:], one[2:]):  # gradients: rounding of the combined logZ / entropy only
        assert a.dtype == b.dtype
        assert (a.double() - b.double()).abs().max() <= 10 * tol * max(1.0, float(b.double().abs().max()))


def test_both_paths_refuse_the_same_inputs():
    h, w, targets, support = _case(0, 4, 12, True, torch.float32)
    outside = PackedSupport.from_sets([[0], [1], [2], [3]], 12)
    for fn in (support_logprobs, vocab_parallel_logprobs):
        with pytest.raises(InputError, match=r"is not in its support \(size 1\)"):
            fn(h, w, torch.tensor([0, 1, 2, 4]), support=outside)
        with pytest.raises(InputError, match="is not an integer"):
            fn(h, w, torch.tensor([0.0, 1.5, 2.0, 3.0]), support=None)
        with pytest.raises(InputError, match="outside vocab"):
            fn(h, w, torch.tensor([0, 1, 2, 12]), support=None)
        with pytest.raises(InputError, match="3 support rows for 4 tokens"):
            fn(h, w, targets, support=PackedSupport.from_sets([[0], [1], [2]], 12))
