"""Per-request sampling knobs, with vLLM's names and meanings, validated once at construction.

The order in which the sampler applies them (as vLLM): penalties and the `min_tokens` mask on the raw logits,
then temperature (0 = greedy: argmax of the penalized logits), then min-p, top-k and top-p, then the draw
(from the request's own random stream when `seed` is set). `logprobs` are those of the raw logits.
"""
import math
import operator
from dataclasses import dataclass

MIN_TEMPERATURE = 0.01  # a lower one but 0 is raised to it (vLLM's _MAX_TEMP)


@dataclass(slots=True)
class SamplingParams:
    # nano-vllm's three fields come first, so its positional calls still work
    temperature: float = 1.0  # 0 means greedy
    max_tokens: int | None = 64  # None: up to max_model_len, as vLLM
    ignore_eos: bool = False
    top_p: float = 1.0  # keep the most likely tokens whose probabilities sum to top_p (1 = off)
    top_k: int = 0  # keep the k most likely tokens (0 or -1 = off)
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one (0 = off)
    seed: int | None = None  # this request's own random stream, whatever else is in the batch
    min_tokens: int = 0  # no EOS, stop token or stop string ends the request before this many tokens
    stop: str | list[str] | None = None  # strings that end the request; never part of the returned text
    stop_token_ids: list[int] | None = None  # ids that end the request, also with ignore_eos
    logprobs: int | None = None  # return the top-k log-probabilities of each token, plus the sampled one's
    presence_penalty: float = 0.0  # subtracted from every token that was generated already
    frequency_penalty: float = 0.0  # subtracted once per time a token was generated already
    repetition_penalty: float = 1.0  # divides positive (multiplies negative) logits of prompt and output tokens
    skip_special_tokens: bool = True

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name}={value!r} must be a number")
            try:
                value = float(value)
            except OverflowError:  # an int past float's range
                value = math.inf if value > 0 else -math.inf
            if not math.isfinite(value):
                raise ValueError(f"{name}={value} must be finite")
            setattr(self, name, value)
        for name in ("top_k", "min_tokens"):
            setattr(self, name, _check_int(name, getattr(self, name)))
        if self.max_tokens is not None:
            self.max_tokens = _check_int("max_tokens", self.max_tokens)
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r} must be a bool")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if 0 < self.temperature < MIN_TEMPERATURE:  # as vLLM: logits / 1e-40 overflow
            self.temperature = MIN_TEMPERATURE
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be >= 1, or 0 or -1 to turn it off")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1 (or None: up to max_model_len)")
        if self.min_tokens < 0 or self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be in [0, max_tokens={self.max_tokens}]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name}={getattr(self, name)} must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be > 0 (1 = off)")
        if self.seed is not None:
            self.seed = _check_int("seed", self.seed)
        if self.logprobs is not None:
            self.logprobs = _check_int("logprobs", self.logprobs)
            if self.logprobs < 0:
                raise ValueError(f"logprobs={self.logprobs} must be >= 0 (0 = only the sampled token's)")
        # normalized to lists, as vLLM does
        stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise TypeError(f"stop={self.stop!r} must be a string or a list of strings")
        if not all(stop):
            raise ValueError(f"stop={self.stop!r}: stop strings must not be empty")
        self.stop = list(stop)
        stop_token_ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if isinstance(stop_token_ids, (str, bytes, dict)) or not hasattr(stop_token_ids, "__iter__"):
            raise TypeError(f"stop_token_ids={self.stop_token_ids!r} must be a list of ints")
        stop_token_ids = [_check_int("a stop token id", token_id) for token_id in stop_token_ids]
        for token_id in stop_token_ids:
            if token_id < 0:
                raise ValueError(f"stop token id {token_id} must be >= 0")
        self.stop_token_ids = stop_token_ids

    @property
    def is_plain(self) -> bool:
        """True when temperature (or greedy) is all this request asks of the sampler: the fast path."""
        return (self.top_p == 1 and self.top_k <= 0 and self.min_p == 0 and self.seed is None
                and self.logprobs is None and self.min_tokens == 0 and self.presence_penalty == 0
                and self.frequency_penalty == 0 and self.repetition_penalty == 1)


def _check_int(name: str, value) -> int:
    """`value` as a Python int; numpy integers are ints too, bools are not."""
    if isinstance(value, bool) or type(value).__name__ == "bool_" or not hasattr(value, "__index__"):
        raise TypeError(f"{name}={value!r} must be an int")
    return operator.index(value)
