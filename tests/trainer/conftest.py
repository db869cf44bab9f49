"""Fixtures of the trainer tests."""
import pytest


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A one-rank gloo process group for a module's megatron models (file rendezvous: no TCP port
    to collide with other test processes); megatron's parallel state destroyed afterwards."""
    import torch.distributed as dist

    own = not dist.is_initialized()
    if own:
        store = tmp_path_factory.mktemp("gloo") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    from skyrl_numerics.trainer.megatron.model import destroy_parallel

    destroy_parallel()
    if own:
        dist.destroy_process_group()
