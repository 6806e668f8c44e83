"""What rank 0's model runner returns for a launched step: its sampled tokens, on their way to the host.

Launching a step never waits for the device: the tokens (and any logprobs) are copied to pinned host memory
behind the step's kernels, and an event marks when they are there. `result()` waits for that event only, so
the host can schedule and launch the next step first (overlap scheduling).
"""
import torch

from nanovllm.layers.sampler import logprob_dicts


class StepOutput:

    def __init__(self, token_ids: torch.Tensor, logprobs: tuple[torch.Tensor, ...] | None = None,
                 num_logprobs: list[int | None] | None = None):
        self.num_logprobs = num_logprobs if logprobs is not None else None
        tensors = [token_ids, *(logprobs or ())]
        self._ready = None
        if token_ids.is_cuda:
            tensors = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                       for t in tensors]
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:  # a copy too: the tensors may be buffers that the next step refills (a decode graph's samples)
            tensors = [t.clone() for t in tensors]
        self._tensors = tensors

    def result(self) -> tuple[list[int], list[dict[int, float] | None] | None]:
        """The token ids, one per sampling sequence, and their logprobs when some sequence asked for them."""
        if self._ready is not None:
            self._ready.synchronize()
        token_ids, *logprobs = (t.tolist() for t in self._tensors)
        if self.num_logprobs is None:
            return token_ids, None
        return token_ids, logprob_dicts(token_ids, *logprobs, self.num_logprobs)
