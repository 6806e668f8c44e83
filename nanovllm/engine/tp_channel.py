"""How rank 0 calls the tensor-parallel workers: (method, args) pickled into a shared-memory buffer, one Event
per worker to wake it. The buffer is named per engine (no two engines share one) and grows when a call
outgrows it: rank 0 makes a buffer twice as big and tells the workers, through the old one, to move.
"""
import multiprocessing as mp
import pickle
from multiprocessing.shared_memory import SharedMemory
from multiprocessing.synchronize import Event

import torch.distributed as dist

SHM_SIZE = 1 << 20


class Channel:

    def __init__(self, name: str, rank: int, events: Event | list[Event]):
        self.rank, self.events = rank, events  # rank 0: every worker's Event; a worker: its own
        self.shm = SharedMemory(name=name, create=True, size=SHM_SIZE) if rank == 0 else None
        dist.barrier()  # the buffer exists before any worker attaches to it
        if rank:
            self.attach(name)

    def post(self, method_name: str, *args):
        """Rank 0: send a call to every worker."""
        data = pickle.dumps([method_name, *args])
        if len(data) + 8 > self.shm.size:
            self._grow(len(data) + 8)
        self._write(data)

    def receive(self) -> tuple[str, list]:
        """A worker: wait for rank 0's next call; exit when rank 0 is gone."""
        while not self.events.wait(1.0):
            if not mp.parent_process().is_alive():  # rank 0 is gone: nobody will ever call again
                raise SystemExit(1)
        n = int.from_bytes(self.shm.buf[0:8], "little")
        method_name, *args = pickle.loads(self.shm.buf[8:n + 8])
        self.events.clear()
        return method_name, args

    def _write(self, data: bytes):
        self.shm.buf[0:8] = len(data).to_bytes(8, "little")
        self.shm.buf[8:len(data) + 8] = data
        for event in self.events:
            event.set()

    def _grow(self, size: int):
        """Move to a buffer at least twice as big: the workers attach to it before the old one goes."""
        old = self.shm
        new = SharedMemory(name=f"{old.name.lstrip('/')}-{size}", create=True, size=max(size, 2 * old.size))
        self._write(pickle.dumps(["_attach_shm", new.name]))  # through the old buffer
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
