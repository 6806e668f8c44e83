"""Tensor-parallel rank and size, as layers are built: the building engine's, else this process's group's (rank 0 of
1 without one), so a TP=1 engine beside a TP>1 one shards nothing."""
from contextlib import contextmanager
from contextvars import ContextVar

import torch.distributed as dist

_building: ContextVar[tuple[int, int] | None] = ContextVar("tp_rank_and_size", default=None)


@contextmanager
def building(rank: int, size: int):
    token = _building.set((rank, size))
    try:
        yield
    finally:
        _building.reset(token)


def tp_rank() -> int:
    engine = _building.get()
    return engine[0] if engine else dist.get_rank() if dist.is_initialized() else 0


def tp_size() -> int:
    engine = _building.get()
    return engine[1] if engine else dist.get_world_size() if dist.is_initialized() else 1
