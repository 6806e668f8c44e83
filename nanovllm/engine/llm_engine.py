"""The user-facing loop: prompts in, one output dict per prompt out, in prompt order."""
import json
import os
import socket
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
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

Prompt = str | list[int]


class LLMEngine:

    def __init__(self, model: str, **engine_args):
        config = Config.from_kwargs(model, **engine_args)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
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
        # runs once: on close(), when the engine is garbage-collected, or at interpreter exit; it holds the
        # runner but not the engine, so a dropped engine frees its memory and workers
        self._finalizer = weakref.finalize(self, shutdown, self.model_runner, self.processes)

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

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams) -> Sequence:
        seq = Sequence(self.encode(prompt), sampling_params)
        self.scheduler.add(seq)
        return seq

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def step(self) -> tuple[list[Sequence], int, int]:
        """One step; returns the sequences it finished and how many prefill and decode tokens it computed."""
        self.check_workers()
        seqs = self.scheduler.schedule()
        if not seqs:
            return [], 0, 0
        num_decode = sum(seq.num_scheduled_tokens == 1 for seq in seqs)
        num_prefill = sum(seq.num_scheduled_tokens for seq in seqs) - num_decode
        token_ids = self.model_runner.call("run", seqs)
        return self.scheduler.postprocess(seqs, token_ids), num_prefill, num_decode

    def generate(self, prompts: list[Prompt] | str,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[dict]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        elif len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params were given for {len(prompts)} prompts; "
                             "give one, or one per prompt")
        for params in sampling_params:
            if not isinstance(params, SamplingParams):
                raise TypeError(f"sampling params must be SamplingParams, not {type(params).__name__}")
        token_ids = [self.encode(prompt) for prompt in prompts]  # every prompt is checked before any runs
        seqs = []
        try:
            for ids, params in zip(token_ids, sampling_params):
                seq = Sequence(ids, params)
                self.scheduler.add(seq)
                seqs.append(seq)
            self._run_until_done(seqs, use_tqdm)
        except BaseException:
            for seq in seqs:  # leave the engine clean for the next call
                self.scheduler.abort(seq)
            raise
        return [self._output(seq) for seq in seqs]

    def _run_until_done(self, seqs: list[Sequence], use_tqdm: bool):
        pbar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_throughput = decode_throughput = 0.0
        num_left = len(seqs)
        while num_left:
            t = perf_counter()
            finished, num_prefill, num_decode = self.step()
            elapsed = perf_counter() - t
            if num_prefill:
                prefill_throughput = num_prefill / elapsed
            elif num_decode:
                decode_throughput = num_decode / elapsed
            pbar.set_postfix(Prefill=f"{int(prefill_throughput)}tok/s", Decode=f"{int(decode_throughput)}tok/s")
            pbar.update(len(finished))
            num_left -= len(finished)
        pbar.close()

    def _output(self, seq: Sequence) -> dict:
        token_ids = seq.completion_token_ids
        return {
            "text": self.tokenizer.decode(token_ids),
            "token_ids": token_ids,
            "finish_reason": seq.finish_reason,
            "num_cached_tokens": max(seq.num_cached_tokens, 0),
        }


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


def shutdown(model_runner: ModelRunner, processes: list):
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
