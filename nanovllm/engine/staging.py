"""A step's host arrays to the device in one copy.

Each `pin_memory().to(device)` of a small array costs a pinned allocation and a copy launch on the host, and a
step has about ten of them. Here a step's arrays are packed into one pinned buffer, allocated once and reused,
and go over in one host-to-device copy; the device tensors are views of it. A CUDA graph replay has its static
buffers filled the same way (`DecodeGraphs.replay`).

Two pinned buffers take turns. With overlap scheduling the host fills step N+1's while the copy of step N may
still wait behind the device's work, so each buffer is refilled only after the event recorded behind its last
copy (that of two steps back, long done: the host has waited for that step's tokens since).
Every step takes exactly one turn, so the event waited on is always two steps old.

On CPU the arrays are used where they are (`torch.from_numpy`): no copy at all, unless `pack` asks for the
CUDA path's packing (in plain host memory), which the tests use to check it without a GPU.
"""
import math

import numpy as np
import torch

ALIGN = 16  # bytes: every piece can be viewed as any dtype, and kernels see pointers as aligned as torch's own
TORCH_DTYPES = {np.dtype(t): getattr(torch, t) for t in ("int64", "int32", "float32")} | {np.dtype(bool): torch.bool}


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class Staging:

    def __init__(self, device: torch.device, pack: bool | None = None, num_buffers: int = 2):
        self.device = device
        self.pack = device.type == "cuda" if pack is None else pack
        self.buffers = [torch.empty(0, dtype=torch.uint8)] * num_buffers
        self.arrays = [buffer.numpy() for buffer in self.buffers]
        self.events: list[torch.cuda.Event | None] = [None] * num_buffers
        self.turn = 0

    def host(self, nbytes: int) -> np.ndarray:
        """The pinned buffer of this turn as uint8, at least `nbytes` long, free to fill."""
        i = self.turn
        if self.events[i] is not None:
            self.events[i].synchronize()
        if len(self.arrays[i]) < nbytes:  # grows by doubling: the sizes of a run settle after a few steps
            self.buffers[i] = torch.empty(max(nbytes, 2 * len(self.arrays[i])), dtype=torch.uint8,
                                          pin_memory=self.device.type == "cuda")
            self.arrays[i] = self.buffers[i].numpy()
        return self.arrays[i]

    def send(self, nbytes: int, dst: torch.Tensor):
        """Copy the first `nbytes` of this turn's buffer into the uint8 device tensor `dst`; the next turn begins."""
        i = self.turn
        dst.copy_(self.buffers[i][:nbytes], non_blocking=True)
        if self.device.type == "cuda":
            if self.events[i] is None:
                self.events[i] = torch.cuda.Event()
            self.events[i].record()
        self.turn = (i + 1) % len(self.buffers)

    def to_device(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """The arrays on the device, in one copy (CUDA) or in place (CPU)."""
        arrays = [np.ascontiguousarray(a) for a in arrays]
        if not self.pack:
            return [torch.from_numpy(a) for a in arrays]
        offsets = np.cumsum([0, *(aligned(a.nbytes) for a in arrays)]).tolist()
        buffer = self.host(offsets[-1])
        for a, start in zip(arrays, offsets):
            buffer[start:start + a.nbytes] = a.reshape(-1).view(np.uint8)
        packed = torch.empty(offsets[-1], dtype=torch.uint8, device=self.device)
        self.send(offsets[-1], packed)
        return [packed[start:start + a.nbytes].view(TORCH_DTYPES[a.dtype]).view(a.shape)
                for a, start in zip(arrays, offsets)]


class StaticInputs:
    """A CUDA graph's static inputs: named arrays that are views of one uint8 device buffer, which a step fills
    from a host mirror of its layout (a pinned staging buffer) in one copy."""

    def __init__(self, fields: list[tuple[str, type, tuple[int, ...]]], device: torch.device):
        """fields: (name, numpy dtype, shape); put the one whose leading rows a step may send alone last."""
        self.layout, start = {}, 0  # name: (byte offset, dtype, shape)
        for name, dtype, shape in fields:
            self.layout[name] = (start, np.dtype(dtype), shape)
            start = aligned(start + np.dtype(dtype).itemsize * math.prod(shape))
        self.buffer = torch.zeros(start, dtype=torch.uint8, device=device)
        self.vars = self.views(self.buffer)

    def views(self, buffer: torch.Tensor | np.ndarray) -> dict:
        """The fields as views of uint8 `buffer`: the device buffer, or a host mirror of its layout."""
        on_device = isinstance(buffer, torch.Tensor)
        return {name: buffer[start:start + dtype.itemsize * math.prod(shape)]
                .view(TORCH_DTYPES[dtype] if on_device else dtype).reshape(shape)
                for name, (start, dtype, shape) in self.layout.items()}

    def host(self, staging: Staging) -> dict:
        """Views of this turn's staging buffer, to fill before `send`."""
        return self.views(staging.host(len(self.buffer)))

    def send(self, staging: Staging, last_rows: int | None = None):
        """Copy the staged fields to the device; of the last field, only its first `last_rows` rows (None: all)."""
        start, dtype, shape = self.layout[next(reversed(self.layout))]
        rows = shape[0] if last_rows is None else last_rows
        nbytes = start + rows * dtype.itemsize * math.prod(shape[1:])
        staging.send(nbytes, self.buffer[:nbytes])
