"""Mixture-of-experts feed-forward (Qwen3-MoE): a router picks `top_k` of `num_experts` gated MLPs per token.

Routing is transformers' to the letter, so that both pick the same experts, ties included: router logits in the
model's dtype, softmax in float32, `torch.topk` over those probabilities (on equal probabilities torch.topk's
own choice on that device, which is not always the lowest index), optionally renormalised to sum to 1, then
cast back to the model's dtype.

Expert weights are stacked, the layout transformers 5 uses in memory: `gate_up_proj` [num_experts,
2 * intermediate, hidden] (each expert's gate rows, then its up rows) and `down_proj` [num_experts, hidden,
intermediate]. Tensor parallelism shards every expert's intermediate dimension (gate/up by rows, down by
columns): each rank computes a partial output for every token and one all-reduce sums them.

Two implementations of the experts, equal up to rounding:
- `experts_torch`: a loop over the experts that got tokens (CPU, and the reference);
- `nanovllm.layers.triton_moe.fused_experts` on CUDA: pairs sorted by expert, one grouped GEMM launch for
  gate/up (silu fused) and one for down (routing weights applied in it); no host syncs, so decode steps run it
  inside CUDA graphs.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.layers import triton_moe
from nanovllm.layers.triton_guard import triton_available
from nanovllm.layers.linear import ReplicatedLinear, copy_weight, divide, tp_shard
from nanovllm.utils.parallel import tp_rank, tp_size


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights [tokens, top_k] in the logits' dtype and expert ids [tokens, top_k] (int64)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), expert_ids


def experts_torch(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                  expert_ids: torch.Tensor) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), one matmul pair per expert that got tokens."""
    top_k = expert_ids.size(1)
    flat_ids = expert_ids.flatten()
    pair_order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=gate_up.size(0)).tolist()
    pair_weights = weights.flatten()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = pair_order[start:start + count]
        start += count
        tokens = pairs // top_k
        gate, up = F.linear(x[tokens], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert]) * pair_weights[pairs, None]
        out.index_add_(0, tokens, y.float())
    return out.to(x.dtype)


class StackedExperts(nn.Module):
    """Every expert's gate/up and down projections as two stacked parameters (this rank's share of each)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.intermediate = divide(intermediate_size, self.tp_size, "moe_intermediate_size")
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate, hidden_size),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate), requires_grad=False)
        for param in (self.gate_up_proj, self.down_proj):
            param.weight_loader = self.weight_loader
        self.gate_up_proj.shard_ids = tuple((e, part) for e in range(num_experts) for part in ("gate", "up"))
        self.down_proj.shard_ids = tuple((e, "down") for e in range(num_experts))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str] | None = None):
        """`shard_id` (expert, "gate" | "up" | "down") for one expert's tensor, as checkpoints store them;
        None for a whole stacked tensor (transformers 5's in-memory layout)."""
        n, rank, tp = self.intermediate, self.tp_rank, self.tp_size
        if shard_id is None:
            if param is self.gate_up_proj:
                if loaded.dim() != 3 or loaded.size(1) % 2:
                    raise ValueError(f"a stacked gate_up_proj must be [num_experts, 2 * intermediate, hidden], "
                                     f"not {list(loaded.shape)}")
                gate, up = loaded.chunk(2, dim=1)
                loaded = torch.cat((tp_shard(gate, 1, n, rank, tp), tp_shard(up, 1, n, rank, tp)), dim=1)
            else:
                loaded = tp_shard(loaded, 2, n, rank, tp)
            copy_weight(param.data, loaded)
            return
        expert, part = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is out of range: the config says num_experts={self.num_experts}")
        if part == "down":
            copy_weight(param.data[expert], tp_shard(loaded, 1, n, rank, tp))
        else:
            offset = 0 if part == "gate" else n
            copy_weight(param.data[expert, offset:offset + n], tp_shard(loaded, 0, n, rank, tp))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and triton_available():
            return triton_moe.fused_experts(x, self.gate_up_proj, self.down_proj, weights, expert_ids)
        return experts_torch(x, self.gate_up_proj, self.down_proj, weights, expert_ids)


class SparseMoeBlock(nn.Module):
    """The MoE feed-forward of one layer; `gate` is the router (its checkpoint name), `experts` the MLPs."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = ReplicatedLinear(hidden_size, num_experts)
        self.experts = StackedExperts(num_experts, hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = route(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights, expert_ids)
        if self.experts.tp_size > 1:
            dist.all_reduce(out)
        return out
