"""Triton, imported under a guard: where it does not import or cannot initialise (a CPU-only machine without
it), `triton` and `tl` are None and TRITON_ERROR says why; modules that define kernels still import, and only
calling a kernel fails."""
import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except Exception as e:
    triton = tl = None
    TRITON_ERROR: Exception | None = e
else:
    TRITON_ERROR = None


def require_triton(what: str):
    """Raises, naming `what` (the kernels a caller launches) and why, where Triton did not import."""
    if triton is None:
        raise RuntimeError(f"{what} cannot run: Triton does not import here ({TRITON_ERROR!r})")


def triton_available() -> bool:
    """Triton imports and a CUDA device is there to run its kernels."""
    return triton is not None and torch.cuda.is_available()


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (an H100/H200's 132 elsewhere: the interpreter's runs)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


PDL = os.environ.get("NANOVLLM_PDL", "1") == "1"


@functools.cache
def pdl_launch(device: torch.device) -> bool:
    """Whether kernels on this device launch with programmatic dependent launch (`triton_skinny` says how they
    use it): CUDA on sm90 or later, with a Triton that has the launch option; off on CPU (the interpreter) and
    with NANOVLLM_PDL=0."""
    if not (PDL and triton is not None and device.type == "cuda"):
        return False
    from triton.backends.nvidia.compiler import CUDAOptions
    return torch.cuda.get_device_capability(device)[0] >= 9 and "launch_pdl" in CUDAOptions.__dataclass_fields__


if triton is not None:
    @triton.jit
    def dependent_start(PDL: tl.constexpr):
        """The start of a kernel launched with `pdl_args` that reads the previous kernel's results at once: let the
        next kernel launch, then wait for the previous one to finish."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
else:
    dependent_start = None


def pdl_args(device: torch.device) -> dict:
    """A launch's arguments for programmatic dependent launch: the kernels' PDL constexpr, which places their
    `gdc_wait`, and Triton's launch option where `pdl_launch` says so."""
    return dict(PDL=True, launch_pdl=True) if pdl_launch(device) else dict(PDL=False)
