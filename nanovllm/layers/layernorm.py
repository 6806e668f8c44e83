import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 like Hugging Face's; with `residual`, adds it first and returns both. (A decode
    step's few rows skip it: the projection after it applies it, `linear`.)"""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        dtype = x.dtype
        if residual is None:
            return self._norm(x.float(), dtype)
        x = x.float() + residual.float()
        residual = x.to(dtype)
        return self._norm(x, dtype), residual
