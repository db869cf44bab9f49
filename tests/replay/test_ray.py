"""PackedRoutes through a real local Ray object store: zero-copy on ray.get."""
import numpy as np
import pytest

from skyrl_numerics.replay import PackedRoutes

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _routes():
    rng = np.random.default_rng(0)
    # big enough (> 100 KiB) that Ray stores it in shared memory, not inline in the reference
    return PackedRoutes.from_sequences([rng.integers(0, 300, size=(n, 4, 8)) for n in (4000, 10, 2500)], 300)


def test_buffer_through_object_store_is_zero_copy(ray_local):
    r = _routes()
    got = ray_local.get(ray_local.put(r.to_buffer()))
    assert not got.flags.writeable  # mapped from the object store, not a private copy
    back = PackedRoutes.from_buffer(got)
    assert back == r
    assert np.shares_memory(back.values, got) and np.shares_memory(back.cu_seqlens, got)
    assert np.shares_memory(back.seq(2), got)


def test_routes_object_through_object_store(ray_local):
    r = _routes()
    back = ray_local.get(ray_local.put(r))  # __reduce__ ships the one buffer out of band
    assert back == r
    assert not back.values.flags.writeable
    assert np.shares_memory(back.values, back.to_buffer())

    @ray_local.remote
    def total(routes):
        return int(routes.values.astype(np.int64).sum()), routes.values.flags.writeable

    s, writeable = ray_local.get(total.remote(ray_local.put(r)))
    assert s == int(r.values.astype(np.int64).sum()) and not writeable
