"""Tensor-parallel rank and size of this process (rank 0 of 1 when no process group is set up)."""
import torch.distributed as dist


def tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
