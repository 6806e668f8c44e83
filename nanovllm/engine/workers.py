"""The tensor-parallel workers' lifecycle, as rank 0 sees it: ranks 1 and up are spawned processes.

- start: `start_workers` spawns them, meets them at rank 0's rendezvous (a TCPStore that counts them in: a worker
  that dies on its way is an error, not a 30-minute wait in init_process_group), then starts rank 0's
  `ModelRunner`; a worker that dies meanwhile is an error naming it, and leaves no worker running.
- watch for death: a dead worker may leave rank 0 in an NCCL collective for good, so a `WorkerWatch` thread acts
  at once: while the engine starts it aborts the collectives; once it runs, `fail_and_abort` first fails every
  request and later call (`WorkerDied`, naming the worker: a freed collective returns garbage), then aborts them.
  A new tensor-parallel engine in this process waits for that abort (`COLLECTIVES_ABORT`).
- rank 0 fails in a step: the workers may wait for good in a collective it never reached, so the engine fails
  every later call (`LLMEngine._step`, after `ModelRunner.out_of_step`).
- rank 0 dies: the workers end quietly (`run_worker`).
- shut down: `shutdown` aborts the requests in flight, then asks the workers to exit, or kills them when a step is
  stuck, a worker is gone or rank 0 left a step, and reaps them (`stop_workers`).
"""
import gc
import os
import signal
import socket
import threading
import time
import traceback
import uuid
from multiprocessing import connection

import torch.distributed as dist
import torch.multiprocessing as mp

from nanovllm.config import Config
from nanovllm.engine.model_runner import ARRIVED, ModelRunner, abort_process_group
from nanovllm.engine.request import EngineLoop
from nanovllm.engine.tp_channel import channel_semaphores, unlink_channel

CLOSE_TIMEOUT = 10.0  # seconds close() waits for a running step before it tears the workers down
# held while a dead worker's engine fails its calls and aborts its collectives (NCCL's may wait over 30 s for the
# dead peer): a new engine's process group must not start before the old one is gone
COLLECTIVES_ABORT = threading.Lock()
ABORT_WAIT = 60.0  # seconds a new tensor-parallel engine waits for that abort before it gives up
RANK_0_EXIT_WAIT = 1.0  # seconds a failed worker waits to learn whether rank 0 is dying


def start_workers(config: Config) -> tuple[list, ModelRunner]:
    """Spawn the workers, meet them at rank 0's rendezvous, then start rank 0's `ModelRunner` in this process;
    returns (the worker processes, rank 0's runner)."""
    processes, semaphores = [], []
    if config.tensor_parallel_size > 1:
        check_no_process_group()
    dist_port = config.dist_port or (free_port() if config.tensor_parallel_size > 1 else 0)
    # rank 0's rendezvous, up before the workers, counts them in (see the module's docstring)
    store = (dist.TCPStore("127.0.0.1", dist_port, config.tensor_parallel_size, is_master=True,
                           wait_for_workers=False) if config.tensor_parallel_size > 1 else None)
    shm_name = f"nanovllm-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    ctx = mp.get_context("spawn")
    for rank in range(1, config.tensor_parallel_size):
        pair = channel_semaphores(ctx)
        reader, writer = ctx.Pipe(duplex=False)
        process = ctx.Process(target=run_worker, args=(writer, config, rank, [pair], dist_port, shm_name))
        process.start()
        process.errors, process.error = reader, None  # (what `run_worker` says of its end: `worker_error`)
        processes.append(process)
        semaphores.append(pair)
    # a worker that dies while rank 0 loads and warms up may leave rank 0 in an NCCL collective for good
    start_watch = WorkerWatch(processes, lambda _: abort_process_group())
    try:
        if store is not None:
            wait_for_workers(store, processes)
        model_runner = ModelRunner(config, 0, semaphores, dist_port, shm_name, store)
        check_alive(processes, "its own error output says why")  # (a freed collective returns garbage)
        start_watch.stop()
    except BaseException as error:  # (a ^C too)
        dead = first_dead(processes)
        start_watch.stop()
        for process in processes:  # a worker that started waits for rank 0's calls for good
            process.kill()
        stop_workers(processes)
        unlink_channel(shm_name)
        gc.unfreeze()  # (as `ModelRunner.exit`: rank 0's runner may have frozen itself)
        # (NCCL's may hang: the watch aborted it; a TP=1 engine leaves a TP>1 one's group alone)
        if config.tensor_parallel_size > 1 and dist.is_initialized() and dist.get_backend() == "gloo":
            dist.destroy_process_group()
        if dead is not None and not isinstance(error, WorkerDied):
            raise worker_died(*dead, "its own error output says why") from error
        raise
    return processes, model_runner


def run_worker(errors, *args):
    """A worker process: rank 1 and up's `ModelRunner`, which serves until rank 0 tells it to exit. An exception
    that ends it is told to rank 0 first (`worker_died` names it), since the process may then end in an abort
    that hides it (gloo's threads at exit: SIGABRT)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C reaches every process: rank 0 answers it
    try:
        ModelRunner(*args)
    except BaseException as error:
        try:
            errors.send("".join(traceback.format_exception_only(error)).strip())
        except BrokenPipeError:  # rank 0 is gone
            pass
        # a worker whose rank 0 died (which may break a collective here before rank 0's pipes close: the wait) ends
        # quietly: nobody reads its traceback, rank 0's resource tracker unlinks the shared memory, and an interpreter
        # exit would only add noise (leak reports of what `ModelRunner` froze) or gloo's abort
        rank_0 = mp.parent_process()
        rank_0.join(RANK_0_EXIT_WAIT)
        if not rank_0.is_alive():
            os._exit(0)
        raise


def worker_error(process) -> str | None:
    """What a worker said of the exception that ended it (`run_worker`), if anything; kept for later calls."""
    try:
        if process.error is None and process.errors.poll():
            process.error = process.errors.recv()
    except (EOFError, OSError):
        pass
    return process.error


class WorkerWatch:
    """Rank 0's watch over the workers: a thread that calls `on_death(rank)` as soon as one dies (NCCL's kernels
    would spin on the GPU for the dead peer, and the host wait on them, forever)."""

    def __init__(self, processes: list, on_death):
        self.processes, self.on_death = processes, on_death
        self._stop_reader, self._stop_writer = mp.get_context("spawn").Pipe(duplex=False)
        self.thread = None
        if processes:
            self.thread = threading.Thread(target=self._run, daemon=True, name="nanovllm-worker-watch")
            self.thread.start()

    def _run(self):
        sentinels = {process.sentinel: rank for rank, process in enumerate(self.processes, start=1)}
        ready = connection.wait([*sentinels, self._stop_reader])
        if self._stop_reader in ready:
            return
        with COLLECTIVES_ABORT:
            self.on_death(sentinels[ready[0]])

    def stop(self):
        """Before the workers exit on purpose (again after a ^C in it). (A watch that fired may be stuck in the
        abort: not waited for.)"""
        if self._stop_writer.closed:
            return
        if self.thread is not None:
            self._stop_writer.send(None)
            self.thread.join(1.0)
        self._stop_writer.close()  # first: a ^C before the reader's close leaves a stop that returns at once
        self._stop_reader.close()


def fail_and_abort(loop: EngineLoop, model_runner: ModelRunner, processes: list, rank: int):
    """A running engine's answer to a dead worker: its requests fail first, since a collective that the abort
    frees returns garbage."""
    loop.fail(worker_died(rank, processes[rank - 1]))
    model_runner.abort_collectives()


class WorkerDied(RuntimeError):
    pass


def worker_died(rank: int, process, advice: str = "close this engine and start a new one") -> WorkerDied:
    """The error for a worker process that has exited."""
    deadline = time.monotonic() + 1
    while process.exitcode is None and time.monotonic() < deadline:  # another thread may be reaping it
        time.sleep(0.005)
    error = worker_error(process)
    return WorkerDied(f"tensor-parallel worker rank {rank} (pid {process.pid}) died with exit code "
                      f"{process.exitcode}{f' after {error}' if error else ''}; {advice}")


def first_dead(processes: list) -> tuple[int, object] | None:
    """(rank, process) of the first worker that has died, if any."""
    return next(((rank, p) for rank, p in enumerate(processes, start=1) if not p.is_alive()), None)


def check_alive(processes: list, advice: str = "close this engine and start a new one"):
    """Raise, naming the first worker that has died."""
    dead = first_dead(processes)
    if dead is not None:
        raise worker_died(*dead, advice)


def check_no_process_group():
    """Before a tensor-parallel engine starts: no process group in this process (one per process), nor an earlier
    engine's abort after a dead worker (waited for up to ABORT_WAIT s)."""
    if not COLLECTIVES_ABORT.acquire(timeout=ABORT_WAIT):
        raise RuntimeError(f"an earlier engine in this process lost a GPU worker and NCCL has not torn its process "
                           f"group down after {ABORT_WAIT:.0f} s; start a new process for a tensor-parallel engine")
    COLLECTIVES_ABORT.release()
    if dist.is_initialized():
        raise RuntimeError("this process already has a torch.distributed process group: another engine with "
                           "tensor_parallel_size > 1 is running in it (close() it first), or one lost a GPU worker "
                           "and NCCL could not tear its group down (start a new process). Engines in separate "
                           "processes can run at once")


def wait_for_workers(store, processes: list):
    """Until every worker has checked in at rank 0's rendezvous (`ModelRunner` does, first thing); a worker
    that dies before is an error, not a hang."""
    while store.add(ARRIVED, 0) < len(processes):
        check_alive(processes, "its own error output says why")
        time.sleep(0.02)


def shutdown(loop: EngineLoop, watch: WorkerWatch, model_runner: ModelRunner, processes: list):
    steps_stopped = False
    try:
        steps_stopped = loop.stop(CLOSE_TIMEOUT)  # every request in flight finishes now, as aborted
    finally:  # a ^C while it waits for a step still tears everything down (close() runs once), then propagates
        teardown(watch, model_runner, processes, steps_stopped)


def teardown(watch: WorkerWatch, model_runner: ModelRunner, processes: list, steps_stopped: bool):
    try:
        watch.stop()
        if steps_stopped and model_runner.out_of_step is None and all(process.is_alive() for process in processes):
            try:
                model_runner.call("exit")
                return
            except Exception:  # a worker died after all (its socket closes before it is reaped): tear down alone
                pass
        # a step still runs, a worker is gone, or rank 0 left a step that the workers still run: no collective can
        # complete; tear down this rank alone
        exit_alone(watch, model_runner, processes)
    except BaseException:  # a ^C in the exit's barrier, the channel's close or the watch's stop: still all of it
        exit_alone(watch, model_runner, processes)
        raise
    finally:
        stop_workers(processes)


def exit_alone(watch: WorkerWatch, model_runner: ModelRunner, processes: list):
    watch.stop()
    for process in processes:
        process.kill()  # which also ends a collective that a stuck step waits in
    model_runner.exit(workers_alive=False)


def stop_workers(processes: list, timeout: float = 10.0):
    for process in processes:
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
