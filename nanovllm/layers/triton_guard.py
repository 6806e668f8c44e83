"""Triton, imported under a guard: where it does not import or cannot initialise (a CPU-only machine without
it), `triton` and `tl` are None and TRITON_ERROR says why; modules that define kernels still import, and only
calling a kernel fails."""
import functools

import torch

try:
    import triton
    import triton.language as tl
except Exception as e:
    triton = tl = None
    TRITON_ERROR: Exception | None = e
else:
    TRITON_ERROR = None


def triton_available() -> bool:
    """Triton imports and a CUDA device is there to run its kernels."""
    return triton is not None and torch.cuda.is_available()


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (an H100/H200's 132 elsewhere: the interpreter's runs)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
