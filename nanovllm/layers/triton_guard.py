"""Triton, imported under a guard: where it does not import or cannot initialise (a CPU-only machine without
it), `triton` and `tl` are None and TRITON_ERROR says why; modules that define kernels still import, and only
calling a kernel fails."""
try:
    import triton
    import triton.language as tl
except Exception as e:
    triton = tl = None
    TRITON_ERROR: Exception | None = e
else:
    TRITON_ERROR = None
