import torch
from torch import nn


class Sampler(nn.Module):
    """Per-row temperature sampling; a temperature of 0 picks the argmax (greedy)."""

    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor,
                generator: torch.Generator | None = None) -> torch.Tensor:
        logits = logits.float()
        greedy = temperatures == 0
        scaled = logits / torch.where(greedy, 1.0, temperatures).unsqueeze(1)
        probs = torch.softmax(scaled, dim=-1)
        # argmax(p / E) with E ~ Exp(1) draws from p (the exponential race), without a host sync
        noise = torch.empty_like(probs).exponential_(1, generator=generator)
        sampled = probs.div_(noise).argmax(dim=-1)
        return torch.where(greedy, logits.argmax(dim=-1), sampled)
