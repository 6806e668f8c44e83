import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """silu(gate) * up, for a merged [gate | up] projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """gelu(gate) * up; `approximate="tanh"` is transformers' "gelu_pytorch_tanh"."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, -1)
        return F.gelu(gate, approximate=self.approximate) * up


# `hidden_act` names of transformers' ACT2FN that mean exactly these functions
GATED_ACTIVATIONS = {
    "silu": SiluAndMul,
    "swish": SiluAndMul,
    "gelu": lambda: GeluAndMul("none"),
    "gelu_pytorch_tanh": lambda: GeluAndMul("tanh"),
}


def gated_activation(hidden_act: str) -> nn.Module:
    if hidden_act not in GATED_ACTIVATIONS:
        raise ValueError(f"hidden_act={hidden_act!r} is not supported; supported activations are "
                         f"{sorted(GATED_ACTIVATIONS)}")
    return GATED_ACTIVATIONS[hidden_act]()
