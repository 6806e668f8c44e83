"""Linear layers that shard their weights across tensor-parallel ranks.

Each parameter carries a `weight_loader(param, loaded_weight[, shard_id])` that copies this rank's slice of
a full checkpoint tensor into it, so the loader never needs to know how a layer is sharded. A parameter filled
from several checkpoint tensors also carries `shard_ids`, every shard id it expects, so that the loader can
name a missing one.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.layers import triton_skinny
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.utils.parallel import tp_rank, tp_size


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm: RMSNorm | None = None,
           act: nn.Module | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """act(F.linear(norm(x), weight, bias)) + residual, each of norm, act and residual optional: in one skinny
    kernel where it fits (`triton_skinny`: few rows, and an act that it fuses, silu), else one layer after the
    other."""
    if triton_skinny.fits(x, weight) and (act is None or type(act) is SiluAndMul):
        return triton_skinny.skinny_linear(x, weight, bias, norm=None if norm is None else (norm.weight, norm.eps),
                                           gated=act is not None, residual=residual)
    y = F.linear(x if norm is None else norm(x), weight, bias)
    if act is not None:
        y = act(y)
    return y if residual is None else y + residual


def copy_weight(dst: torch.Tensor, src: torch.Tensor):
    """copy_ without broadcasting: a checkpoint tensor of the wrong shape is an error, never a silent fill."""
    if dst.shape != src.shape:
        raise ValueError(f"this rank's part has shape {list(src.shape)}, the parameter {list(dst.shape)}")
    dst.copy_(src)


def tp_shard(loaded: torch.Tensor, dim: int, size: int, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s `size` slices along `dim` of a full checkpoint tensor, which must hold exactly `tp` of them."""
    if loaded.dim() <= dim or loaded.size(dim) != size * tp:
        raise ValueError(f"shape {list(loaded.shape)} should have {size * tp} along dimension {dim}")
    return loaded.narrow(dim, rank * size, size)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} does not divide by tensor_parallel_size={denominator}")
    return numerator // denominator


class LinearBase(nn.Module):

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None):
        super().__init__()
        self.tp_dim = tp_dim
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor):
        if self.tp_dim is not None and param.dim() > self.tp_dim:
            loaded_weight = tp_shard(loaded_weight, self.tp_dim, param.size(self.tp_dim), self.tp_rank, self.tp_size)
        copy_weight(param.data, loaded_weight)

    def forward(self, x: torch.Tensor, norm: RMSNorm | None = None, act: nn.Module | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """act(norm(x) @ weight.T + bias) + residual, as `linear`."""
        return linear(x, self.weight, self.bias, norm, act, residual)


class ReplicatedLinear(LinearBase):

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias, tp_dim=None)


class ColumnParallelLinear(LinearBase):

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, divide(output_size, tp_size(), "output_size"), bias, tp_dim=0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)
        for param in self.parameters():
            param.shard_ids = tuple(range(len(output_sizes)))

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int):
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        shard = tp_shard(loaded_weight, 0, size, self.tp_rank, self.tp_size)
        copy_weight(param.data.narrow(0, offset, size), shard)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; each rank holds its own heads of each. With fewer KV heads than
    ranks (as vLLM), each KV head is replicated on the tensor_parallel_size / num_kv_heads ranks whose query
    heads read it, so every rank holds one."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        n = tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, n, "num_attention_heads")
        if num_kv_heads < n and n % num_kv_heads:
            raise ValueError(f"num_key_value_heads={num_kv_heads} neither divides by tensor_parallel_size={n} nor "
                             f"divides it (to replicate each KV head on {n} / {num_kv_heads} ranks)")
        self.num_kv_heads = max(num_kv_heads // n, 1)
        self.kv_shards = min(num_kv_heads, n)  # distinct KV slices: rank r holds slice r * kv_shards // n
        super().__init__(hidden_size, (num_heads + 2 * self.num_kv_heads * n) * head_dim, bias)
        for param in self.parameters():
            param.shard_ids = ("q", "k", "v")

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str):
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            shard = tp_shard(loaded_weight, 0, q_size, self.tp_rank, self.tp_size)
        else:
            shard = tp_shard(loaded_weight, 0, kv_size, self.tp_rank * self.kv_shards // self.tp_size,
                             self.kv_shards)
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        copy_weight(param.data.narrow(0, offset, size), shard)


class RowParallelLinear(LinearBase):

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(divide(input_size, tp_size(), "input_size"), output_size, bias, tp_dim=1)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight.T + bias (+ residual), summed over the ranks."""
        if self.tp_size == 1:
            return linear(x, self.weight, self.bias, residual=residual)
        # the bias is added once, on rank 0, so the all-reduce sums it exactly once; the residual after it
        y = linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        dist.all_reduce(y)
        return y if residual is None else y + residual
