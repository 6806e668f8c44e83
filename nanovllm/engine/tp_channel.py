"""How rank 0 calls the tensor-parallel workers: (method, args) pickled into a shared-memory buffer, and two
semaphores per worker that pass the buffer back and forth: `wake` (a call is there) and `taken` (the worker has
it in hand, so the buffer may be written again). Rank 0 never waits for a call to be carried out, only for the
previous one to be taken: with overlap scheduling it posts step N+1 while the workers may still be launching
step N (NCCL's collectives do not hold it back). Semaphores, not Events: `Event.set()` waits for every process
asleep in `wait()` to wake, forever if one was killed there; a semaphore's release never waits. The buffer is
named per engine (no two engines share one) and grows when a call outgrows it: rank 0 makes a buffer twice
as big and tells the workers, through the old one, to move.

Each side counts what the channel costs it: rank 0 the time to post a call, a worker the time from the post
to the call in its hands (the clock is the host's monotonic one, which every process reads alike).
"""
import multiprocessing as mp
import pickle
import struct
import time
from multiprocessing.shared_memory import SharedMemory
from multiprocessing.synchronize import Semaphore

import torch.distributed as dist

SHM_SIZE = 1 << 20
HEADER = struct.Struct("<Qd")  # the call's length in bytes, when it was posted


def channel_semaphores(ctx) -> tuple[Semaphore, Semaphore]:
    """A worker's (wake, taken): no call yet, and the buffer free."""
    return ctx.Semaphore(0), ctx.Semaphore(1)


def unlink_channel(name: str):
    """Remove rank 0's buffer, if it exists, of an engine that did not start."""
    try:
        SharedMemory(name=name).unlink()
    except FileNotFoundError:
        pass


class Channel:

    def __init__(self, name: str, rank: int, semaphores: list[tuple[Semaphore, Semaphore]]):
        self.rank = rank
        # rank 0: every worker's (wake, taken); a worker: its own, alone in the list
        self.wake, self.taken = (list(s) for s in zip(*semaphores))
        self.broken = False  # a worker is gone: no call will be taken
        self.num_calls, self.seconds = 0, 0.0
        self.shm = SharedMemory(name=name, create=True, size=SHM_SIZE) if rank == 0 else None
        dist.barrier()  # the buffer exists before any worker attaches to it
        if rank:
            self.attach(name)

    def post(self, method_name: str, *args):
        """Rank 0: send a call to every worker."""
        start = time.perf_counter()
        data = pickle.dumps([method_name, *args])
        if len(data) + HEADER.size > self.shm.size:
            self._grow(len(data) + HEADER.size)
        self._write(data, start)
        self.num_calls += 1
        self.seconds += time.perf_counter() - start

    def receive(self) -> tuple[str, list]:
        """A worker: wait for rank 0's next call; exit when rank 0 is gone."""
        while not self.wake[0].acquire(timeout=1.0):
            if not mp.parent_process().is_alive():  # rank 0 is gone: nobody will ever call again
                raise SystemExit(1)
        n, posted = HEADER.unpack_from(self.shm.buf)
        method_name, *args = pickle.loads(self.shm.buf[HEADER.size:HEADER.size + n])
        self.taken[0].release()
        self.num_calls += 1
        self.seconds += time.perf_counter() - posted
        return method_name, args

    def _write(self, data: bytes, posted: float):
        for taken in self.taken:  # every worker has the previous call in hand
            while not taken.acquire(timeout=1.0) and not self.broken:
                pass
        if self.broken:
            raise RuntimeError("a tensor-parallel worker is gone: it cannot take calls")
        HEADER.pack_into(self.shm.buf, 0, len(data), posted)
        self.shm.buf[HEADER.size:HEADER.size + len(data)] = data
        for wake in self.wake:
            wake.release()

    def abort(self):
        """From another thread, when a worker has died: a post waiting for it raises, and so does every later one."""
        self.broken = True
        for taken in self.taken:
            taken.release()

    def _grow(self, size: int):
        """Move to a buffer at least twice as big: the workers attach to it before the old one goes."""
        old = self.shm
        new = SharedMemory(name=f"{old.name.lstrip('/')}-{size}", create=True, size=max(size, 2 * old.size))
        self._write(pickle.dumps(["_attach_shm", new.name]), time.perf_counter())  # through the old buffer
        dist.barrier()  # every worker has attached to the new buffer and let go of the old one
        old.close()
        old.unlink()
        self.shm = new

    def attach(self, name: str):
        """A worker's side of a new buffer (rank 0 owns and unlinks every buffer)."""
        # the spawned workers share rank 0's resource tracker, which unlinks the segment if rank 0 dies
        old, self.shm = self.shm, SharedMemory(name=name)
        if old is not None:
            old.close()
            dist.barrier()

    def close(self):
        if self.shm is not None:
            self.shm.close()
            if self.rank == 0:
                self.shm.unlink()
            self.shm = None
