"""Per-request sampling knobs."""
import math
from dataclasses import dataclass


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    max_tokens: int = 64
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise TypeError(f"temperature={self.temperature!r} must be a number")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be finite and >= 0 (0 means greedy)")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise TypeError(f"max_tokens={self.max_tokens!r} must be an int")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos={self.ignore_eos!r} must be a bool")
        self.temperature = float(self.temperature)
