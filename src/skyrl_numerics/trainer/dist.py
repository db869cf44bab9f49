"""Process-group plumbing for the FSDP2 trainer: gloo on CPU, NCCL on GPU, same code.

- :func:`init_distributed` joins the group described by the torchrun environment
  (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``).
- :func:`spawn` starts ``world_size`` local processes (``torch.multiprocessing``) on a free port and
  runs ``fn(rank, world_size, *args)`` in each after :func:`init_distributed` (a CPU test harness,
  and the way to run the trainer without torchrun).
- :func:`shard_rows` is the data-parallel split: contiguous, near-equal blocks of sequences.
"""
from __future__ import annotations

import os
import socket

import numpy as np

__all__ = ["init_distributed", "spawn", "shard_rows", "rank_and_world", "free_port"]


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default group, ``(0, 1)`` when none is initialized."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_distributed(backend: str | None = None) -> tuple[int, int]:
    """Join the default process group from the torchrun environment; returns ``(rank, world_size)``.

    ``backend`` defaults to ``nccl`` when CUDA is available, else ``gloo``. With NCCL the process's
    CUDA device is ``LOCAL_RANK``. A no-op when the group already exists.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, backend, threads, fn, args):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    if threads:
        torch.set_num_threads(threads)
    init_distributed(backend)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn, world_size: int, *args, backend: str | None = None, threads: int | None = 1,
          timeout: float | None = None) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes; raise if any fails.

    ``fn`` must be importable (module level). ``threads`` sets ``torch.set_num_threads`` per process
    (1 by default: ranks share the machine's cores). ``timeout`` (seconds): past it the processes
    are killed and TimeoutError is raised (a collective that only some ranks entered hangs forever).
    """
    import time

    import torch.multiprocessing as mp

    ctx = mp.start_processes(_entry, args=(world_size, free_port(), backend, threads, fn, args),
                             nprocs=world_size, join=False, start_method="spawn")
    deadline = None if timeout is None else time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if deadline is not None and time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join()
            raise TimeoutError(f"{world_size} ranks did not finish within {timeout} s")


def shard_rows(n_rows: int, world_size: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s sequences: block ``rank`` of ``np.array_split(arange(n_rows), world_size)``."""
    return np.array_split(np.arange(n_rows, dtype=np.int64), world_size)[rank]
