"""The paged KV cache of one rank: how many blocks it holds, and the one tensor of them whose slices the attention
layers read and write ([2 (keys, values), layers, blocks, block_size, kv_heads, head_dim])."""
import logging
import os

import numpy as np
import torch

from nanovllm.config import Config
from nanovllm.layers.attention import Attention

logger = logging.getLogger(__name__)

CPU_KV_CACHE_SHARE = 0.25  # of available RAM, at most, for the cache on CPU


def block_bytes(attn_layers: list[Attention], block_size: int, dtype: torch.dtype) -> int:
    """A block's keys and values in every layer (FP8: one byte a value, so twice the tokens in the same memory)."""
    layer = attn_layers[0]
    return 2 * len(attn_layers) * block_size * layer.num_kv_heads * layer.head_dim * dtype.itemsize


def cpu_blocks(config: Config, block_size: int, block_bytes: int) -> int:
    """Blocks enough for max_num_seqs sequences of max_model_len, within CPU_KV_CACHE_SHARE of the free RAM."""
    enough = -(-config.max_num_seqs * config.max_model_len // block_size)
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(min(enough, int(available * CPU_KV_CACHE_SHARE) // block_bytes), 1)


def fit_to_blocks(config: Config, num_blocks: int, block_size: int):
    """Records the cache's size in the config, lowering max_model_len to what it holds; a CUDA cache sized from
    memory that cannot hold one max_model_len is an error that says what to change."""
    capacity = num_blocks * block_size
    if capacity < config.max_model_len:
        if config.device == "cuda" and config.num_kvcache_blocks < 0:
            raise ValueError(
                f"the KV cache fits {capacity} tokens ({num_blocks} blocks of {block_size}), fewer than "
                f"max_model_len={config.max_model_len}; raise gpu_memory_utilization or lower max_model_len")
        logger.warning("max_model_len lowered from %d to %d: the KV cache holds %d blocks of %d tokens",
                       config.max_model_len, capacity, num_blocks, block_size)
        config.max_model_len = capacity
    config.num_kvcache_blocks = num_blocks


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, but on CPU from calloc (numpy's zeros): the OS maps in zeroed pages as they are first touched,
    so a cache sized for the worst case (a gigabyte for the tiny test model) costs no time to write at start."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.from_numpy(np.zeros(int(np.prod(shape)) * dtype.itemsize, np.uint8)).view(dtype).view(shape)


def make_kv_cache(attn_layers: list[Attention], num_blocks: int, block_size: int, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """The cache, each layer given its keys' and values' slices. Zeros, not empty: a kernel may read the rows past
    a sequence's end in its last block (then masked)."""
    layer = attn_layers[0]
    cache = zeros((2, len(attn_layers), num_blocks, block_size, layer.num_kv_heads, layer.head_dim), dtype, device)
    for i, layer in enumerate(attn_layers):
        layer.k_cache, layer.v_cache = cache[0, i], cache[1, i]
    return cache
