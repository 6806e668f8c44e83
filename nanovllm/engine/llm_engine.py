"""The user-facing loop: prompts in, one output dict per prompt out, in prompt order."""
import asyncio
import json
import os
import socket
import threading
import uuid
import weakref
from time import perf_counter

import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from nanovllm.config import Config
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.request import EngineLoop, RequestHandle
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams

Prompt = str | list[int]


class LLMEngine:

    def __init__(self, model: str, **engine_args):
        config = Config.from_kwargs(model, **engine_args)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        self._tokenizer_lock = threading.Lock()  # HF fast tokenizers are not safe to call from two threads
        config.eos_token_ids = eos_token_ids(config.model, self.tokenizer)
        self.config = config
        self.processes, self.events = [], []
        if config.tensor_parallel_size > 1 and dist.is_initialized():
            raise RuntimeError("another engine with tensor_parallel_size > 1 is running in this process; "
                               "close() it first (engines in separate processes can run at once)")
        dist_port = config.dist_port or (free_port() if config.tensor_parallel_size > 1 else 0)
        shm_name = f"nanovllm-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        ctx = mp.get_context("spawn")
        for rank in range(1, config.tensor_parallel_size):
            event = ctx.Event()
            process = ctx.Process(target=ModelRunner, args=(config, rank, event, dist_port, shm_name))
            process.start()
            self.processes.append(process)
            self.events.append(event)
        try:
            self.model_runner = ModelRunner(config, 0, self.events, dist_port, shm_name)
        except BaseException:
            stop_workers(self.processes)
            raise
        self.scheduler = Scheduler(config)
        self._handles: dict[int, RequestHandle] = {}
        self._throughput: dict[str, str] = {}
        self._loop = EngineLoop()
        # runs once: on close(), when the engine is garbage-collected, or at interpreter exit; it holds the
        # runner but not the engine, so a dropped engine frees its memory and workers
        self._finalizer = weakref.finalize(self, shutdown, self._loop, self.model_runner, self.processes)

    def close(self):
        """Stop the workers and free the KV cache and shared memory; safe to call more than once."""
        self._finalizer()

    exit = close  # nano-vllm's name

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def check_workers(self):
        """Raise at once, instead of hanging in a collective, when a worker process has died."""
        if not self._finalizer.alive:
            raise RuntimeError("the engine is closed")
        for rank, process in enumerate(self.processes, start=1):
            if not process.is_alive():
                raise RuntimeError(f"tensor-parallel worker rank {rank} (pid {process.pid}) died with exit code "
                                   f"{process.exitcode}; close this engine and start a new one")

    # ---- requests ----------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt, checked against the vocabulary and max_model_len."""
        if isinstance(prompt, str):
            with self._tokenizer_lock:
                token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
                raise TypeError("a token-id prompt must be a list of ints")
        else:
            raise TypeError(f"a prompt must be a str or a list of token ids, not {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("the prompt is empty: it must hold at least one token")
        vocab_size = self.config.hf_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        if len(token_ids) > self.config.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, more than max_model_len="
                             f"{self.config.max_model_len}")
        return token_ids

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams) -> RequestHandle:
        return self.submit(prompt, sampling_params)

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def stats(self) -> dict:
        bm = self.scheduler.block_manager
        return {"num_free_blocks": bm.num_free_blocks, "num_total_blocks": len(bm.blocks),
                "num_waiting": len(self.scheduler.waiting), "num_running": len(self.scheduler.running),
                "num_preemptions": self.scheduler.num_preemptions}

    # ---- the online API -----------------------------------------------------------------------------
    def submit(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> RequestHandle:
        """Queue a request from any thread, at any time; returns its handle at once."""
        return self._submit([self.encode(prompt)], [self._check_params(sampling_params)], stream=True)[0]

    async def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None):
        """`async for increment in llm.stream(prompt, params)`: the increments of one request."""
        loop, increments = asyncio.get_running_loop(), asyncio.Queue()
        handle = self._submit([self.encode(prompt)], [self._check_params(sampling_params)], stream=True,
                              listener=(loop, increments))[0]
        try:
            while True:
                item = await increments.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item["finished"]:
                    return
        finally:
            if not handle.finished:
                handle.abort()

    def _submit(self, token_ids: list[list[int]], params: list[SamplingParams], stream: bool,
                listener=None) -> list[RequestHandle]:
        self.check_workers()
        handles = []
        for ids, p in zip(token_ids, params):
            handle = RequestHandle(self, Sequence(ids, p), stream)
            if listener is not None:
                handle._listeners.append(listener)
            handles.append(handle)
        with self._loop.cond:
            self._loop.inbox.extend(("add", h) for h in handles)
            self._loop.start(self)
            self._loop.cond.notify()
        return handles

    def _abort(self, handle: RequestHandle):
        with self._loop.cond:
            self._loop.inbox.append(("abort", handle))
            self._loop.cond.notify()

    def _run_once(self) -> bool:
        """The loop thread's work: take new requests and aborts, then one step; False when idle."""
        with self._loop.cond:
            inbox, self._loop.inbox = self._loop.inbox, []
        for kind, handle in inbox:
            if kind == "add":
                self._handles[handle.request_id] = handle
                self.scheduler.add(handle.seq)
            elif self._handles.pop(handle.request_id, None) is not None:
                seq = handle.seq
                self.scheduler.abort(seq)
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
                handle._on_finish([])
        if self.scheduler.is_finished():
            return False
        try:
            self.step()
        except BaseException as error:  # fail every request in flight and leave the scheduler empty
            for handle in self._handles.values():
                self.scheduler.abort(handle.seq)
                handle._on_error(error)
            self._handles.clear()
        return True

    def step(self) -> tuple[list[Sequence], int, int]:
        """One step; returns the sequences it finished and how many prefill and decode tokens it computed."""
        self.check_workers()
        seqs = self.scheduler.schedule()
        if not seqs:
            return [], 0, 0
        num_decode = sum(seq.num_scheduled_tokens == 1 for seq in seqs)
        num_prefill = sum(seq.num_scheduled_tokens for seq in seqs) - num_decode
        sampled = [seq for seq in seqs if seq.samples_this_step]
        t = perf_counter()
        token_ids, logprobs = self.model_runner.call("run", seqs)
        finished = self.scheduler.postprocess(seqs, token_ids, logprobs)
        elapsed = perf_counter() - t
        if num_prefill:
            self._throughput["Prefill"] = f"{int(num_prefill / elapsed)}tok/s"
        elif num_decode:
            self._throughput["Decode"] = f"{int(num_decode / elapsed)}tok/s"
        for seq in sampled:
            handle = self._handles.get(seq.seq_id)
            if handle is not None and handle._on_token(seq.last_token):  # a stop string ended it
                if seq.is_finished:
                    seq.finish_reason = "stop"
                else:
                    self.scheduler.finish(seq, "stop")
                    finished.append(seq)
        for seq in finished:
            handle = self._handles.pop(seq.seq_id, None)
            if handle is not None:
                handle._on_finish([seq.last_token])
        return finished, num_prefill, num_decode

    # ---- offline batches ----------------------------------------------------------------------------
    def generate(self, prompts: list[Prompt] | str,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[dict]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        elif len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params were given for {len(prompts)} prompts; "
                             "give one, or one per prompt")
        params = [self._check_params(p) for p in sampling_params]
        token_ids = [self.encode(prompt) for prompt in prompts]  # every prompt is checked before any runs
        handles = self._submit(token_ids, params, stream=False)
        try:
            with tqdm(total=len(handles), desc="Generating", dynamic_ncols=True, disable=not use_tqdm) as pbar:
                for handle in handles:
                    while not handle._done.wait(0.1):
                        pbar.set_postfix(self._throughput)
                        pbar.n = sum(h.finished for h in handles)
                        pbar.refresh()
                pbar.n = len(handles)
            return [handle.result() for handle in handles]
        except BaseException:
            for handle in handles:  # leave the engine clean for the next call
                if not handle.finished:
                    handle.abort()
            raise

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        with self._tokenizer_lock:
            return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def _check_params(self, params) -> SamplingParams:
        """SamplingParams checks itself; what depends on the model is checked here."""
        if params is None:
            return SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, not {type(params).__name__}")
        vocab_size = self.config.hf_config.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        if params.logprobs is not None and params.logprobs > vocab_size:
            raise ValueError(f"logprobs={params.logprobs} is more than the vocabulary size {vocab_size}")
        return params


def eos_token_ids(model_dir: str, tokenizer) -> tuple[int, ...]:
    """The tokenizer's EOS plus every EOS id in generation_config.json."""
    ids = set() if tokenizer.eos_token_id is None else {tokenizer.eos_token_id}
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            extra = json.load(f).get("eos_token_id")
        if extra is not None:
            ids.update([extra] if isinstance(extra, int) else extra)
    return tuple(sorted(ids))


def shutdown(loop: EngineLoop, model_runner: ModelRunner, processes: list):
    loop.stop()
    workers_alive = all(process.is_alive() for process in processes)
    try:
        if workers_alive:
            model_runner.call("exit")
        else:  # no collective can complete: tear down this rank alone
            model_runner.exit(workers_alive=False)
    finally:
        stop_workers(processes)


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
