"""The user-facing loop: prompts in, one output dict per prompt out, in prompt order."""
import asyncio
import json
import operator
import os
import sys
import threading
import weakref
from dataclasses import dataclass, replace
from functools import partial
from time import perf_counter, sleep

import numpy as np

from tqdm.auto import tqdm
from transformers import AutoTokenizer

from nanovllm.config import Config
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.request import EngineLoop, RequestHandle
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step_output import StepOutput
from nanovllm.engine.workers import (WorkerDied, WorkerWatch, check_alive, fail_and_abort, first_dead, shutdown,
                                     start_workers, teardown, worker_died)
from nanovllm.sampling_params import SamplingParams

Prompt = str | list[int]
WORKER_REAP_S = 1.0  # a failed TP step's wait to learn whether a worker died in it


class LLMEngine:

    def __init__(self, model: str, **engine_args):
        config = Config.from_kwargs(model, **engine_args)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        if len(self.tokenizer) <= len(self.tokenizer.all_special_ids):  # transformers' tokenizer of no files
            raise ValueError(f"model folder {config.model!r} has no tokenizer (tokenizer.json, tokenizer.model, ...)")
        self._tokenizer_lock = threading.Lock()  # HF fast tokenizers are not safe to call from two threads
        config.eos_token_ids = eos_token_ids(config.model, self.tokenizer)
        self.sampling_defaults = sampling_defaults(config.model)  # what `sampling_params=None` means, as vLLM
        self.config = config
        self._in_flight: Step | None = None  # launched, its tokens not yet accounted for
        self._last_completed = 0.0
        self._throughput: dict[str, str] = {}
        self.processes, self.model_runner = start_workers(config)
        try:
            self.scheduler = Scheduler(config, on_release=self.model_runner.penalty_slots.release)
            self._loop = EngineLoop(self)
            self._watch = WorkerWatch(self.processes, partial(fail_and_abort, self._loop, self.model_runner,
                                                              self.processes))
            # runs once: on close(), when the engine is garbage-collected, or at interpreter exit; it holds the
            # runner and the requests but not the engine, so a dropped engine frees its memory and workers
            self._finalizer = weakref.finalize(self, shutdown, self._loop, self._watch, self.model_runner,
                                               self.processes)
        except BaseException:  # (a ^C too) nothing else would stop the workers
            teardown(WorkerWatch([], None), self.model_runner, self.processes, steps_stopped=False)
            raise
        self._closing = threading.Lock()  # a close() beside one in progress returns when that one has ended

    def close(self):
        """Abort every request in flight (each finishes with finish_reason "abort" and the tokens it has, so
        calls waiting on them in other threads return), then stop the workers and free the KV cache and
        shared memory. Returns within about `workers.CLOSE_TIMEOUT` s; safe to call more than once."""
        with self._closing:
            self._finalizer()

    exit = close  # nano-vllm's name

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def check_workers(self):
        """Raise at once, instead of hanging in a collective, when a worker process has died."""
        self._loop.check()
        check_alive(self.processes)

    # ---- requests ----
    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt, checked against the vocabulary and max_model_len."""
        if isinstance(prompt, str):
            with self._tokenizer_lock:
                token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            token_ids = token_id_list(prompt)
            if token_ids is None:
                raise TypeError(f"a token-id prompt must be a list of ints, not {prompt!r:.80}")
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

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> RequestHandle:
        """nano-vllm's way: queue a request for your own `step()` loop (no background thread steps it, until
        something waits on a handle or `generate()` or `submit()` ran; `step()` returns it finished either way)."""
        return self._submit([self.encode(prompt)], [self._check_params(sampling_params)], stream=False,
                            start=False)[0]

    def is_finished(self) -> bool:
        """True when no request is queued or running, and `step()` has returned each finished `add_request` one."""
        loop = self._loop
        with loop.cond:  # (under which requests move from the inbox to the table)
            queued = loop.inbox or loop.handles
        # the table before `unreported`: a request enters `unreported` before it leaves the table
        return not queued and not loop.unreported and self.scheduler.is_finished() and self._in_flight is None

    def stats(self) -> dict:
        bm = self.scheduler.block_manager
        return {"num_free_blocks": bm.num_free_blocks, "num_total_blocks": bm.num_blocks,
                "num_waiting": len(self.scheduler.waiting), "num_running": len(self.scheduler.running),
                "num_preemptions": self.scheduler.num_preemptions}

    # ---- the online API ----
    def submit(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> RequestHandle:
        """Queue a request from any thread, at any time; returns its handle at once."""
        return self._submit([self.encode(prompt)], [self._check_params(sampling_params)], stream=True)[0]

    async def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None):
        """`async for increment in llm.stream(prompt, params)`: the increments of one request. Leaving the
        loop early aborts the request."""
        listener = (asyncio.get_running_loop(), asyncio.Queue())
        handle = self._submit([self.encode(prompt)], [self._check_params(sampling_params)], stream=True,
                              listener=listener)[0]
        try:
            while True:
                item = await listener[1].get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item["finished"]:
                    return
        finally:
            handle._remove_listener(listener)
            if not handle.finished:
                handle.abort()

    def _submit(self, token_ids: list[list[int]], params: list[SamplingParams], stream: bool,
                listener=None, start: bool = True) -> list[RequestHandle]:
        self.check_workers()
        handles = [RequestHandle(self._loop, self.tokenizer, self._tokenizer_lock, Sequence(ids, p), stream,
                                 for_step=not start) for ids, p in zip(token_ids, params)]
        if listener is not None:
            handles[0]._add_listener(listener)
        try:
            self._loop.post("add", *handles)
            if start:
                self._loop.start()
        except BaseException:  # (^C) the caller never gets the handles, so nobody would end these requests
            for handle in handles:
                handle.abort()
            raise
        return handles

    def _take_inbox(self) -> bool:
        """Take in new requests and aborts; True when there is work to step. An error on the way (a ^C in a
        caller's `step()`) fails the request it was taking in and leaves the ones after it in the inbox: none is
        left in the table unfinished and unscheduled, for its waiters to wait on for good."""
        inbox = self._loop.take_inbox()
        for i, (kind, handle) in enumerate(inbox):
            try:
                if kind == "add":  # (take_inbox put it in the table)
                    if not handle.finished:  # (close() may have ended it on its way in)
                        self.scheduler.add(handle.seq)
                elif handle.request_id in self._loop.handles:
                    self.scheduler.abort(handle.seq)
                    handle._end_aborted()  # (if that fails, it fails alone: the rest of the inbox is taken in)
                    self._loop.handles.pop(handle.request_id, None)  # (close() may have emptied the table)
            except BaseException as error:
                self._loop.put_back(inbox[i + 1:])
                self._loop.handles.pop(handle.request_id, None)
                self.scheduler.abort(handle.seq)
                handle._on_error(error)
                raise
        return not self.scheduler.is_finished() or self._in_flight is not None

    def _run_once(self) -> bool:
        """The loop thread's work: take new requests and aborts, then one step; False when idle."""
        with self._loop.step_lock:
            if not self._take_inbox():
                return False
            try:
                self._step()
            except Exception:  # the requests in flight have failed with it; the engine serves the next ones
                pass
        return True

    def step(self) -> tuple[list[tuple[int, list[int]]], int]:
        """nano-vllm's step, for `add_request` + `while not llm.is_finished(): llm.step()` loops: take in new
        requests, run one step; returns the (request id, completion token ids) of the requests it finished and
        of the `add_request` ones finished since the last call (by the background thread, once it runs), and its
        prefill tokens (> 0) or, for a decode-only step, minus its decode tokens."""
        self.check_workers()
        with self._loop.step_lock:
            self._loop.check()  # close() may have begun while this call waited for the lock
            self._take_inbox()
            finished, num_prefill, num_decode = self._step()
            done, self._loop.unreported = self._loop.unreported, {}
        done.update((seq.seq_id, seq.completion_token_ids) for seq in finished)
        return list(done.items()), num_prefill or -num_decode

    def _step(self) -> tuple[list[Sequence], int, int]:
        """One step (under `step_lock`); returns the sequences it finished and how many prefill and decode
        tokens it computed. When it raises, every request in flight fails with the error, which propagates."""
        try:
            return self._pipelined_step()
        except BaseException as error:  # fail every request in flight and leave the scheduler empty
            self._in_flight = None
            died = self._worker_death(error)
            # the requests first: a scheduler that raised may raise again when it aborts its sequences. Once
            # close() has begun, it aborts them all, whatever this step raised, and may add the inbox's to the table
            handles = self._loop.handles
            if not self._loop.stopping:
                for request_id, handle in list(handles.items()):
                    handle._on_error(died or error)
                    handles.pop(request_id, None)
            for seq in [*self.scheduler.waiting, *self.scheduler.running]:
                self.scheduler.abort(seq)
            if self.model_runner.out_of_step is not None:  # the workers may wait in a collective for good
                dead = died or RuntimeError(f"rank 0 failed in a step that its tensor-parallel workers ran too "
                                            f"({error!r}), and they may wait for it for good: close this engine "
                                            "and start a new one")
                dead.__cause__ = error
                self._loop.fail(dead)
            if died is not None:
                raise died from error
            raise

    def _worker_death(self, error: BaseException) -> WorkerDied | None:
        """The error naming the worker whose death failed this tensor-parallel step: a collective's own error can
        reach rank 0 before the dead process is reaped, so wait up to WORKER_REAP_S for one (not after a ^C)."""
        if self.model_runner.out_of_step is None or not self.processes or not isinstance(error, Exception):
            return None
        deadline = perf_counter() + WORKER_REAP_S
        while (dead := first_dead(self.processes)) is None:
            if perf_counter() > deadline:
                return None
            sleep(0.01)
        died = worker_died(*dead)
        died.__cause__ = error
        return died

    def _pipelined_step(self) -> tuple[list[Sequence], int, int]:
        """Schedule and launch step N, then complete step N-1 while the device runs N (overlap scheduling:
        the host's work hides behind the device's). Without async_scheduling, step N completes at once."""
        self.check_workers()
        finished = []
        seqs = self.scheduler.schedule()
        # a decode computes a generated token; a prompt's last token alone (a one-token prompt, a prefix hit) is prefill
        num_decode = sum(seq.num_scheduled_tokens == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens
                         for seq in seqs)
        num_prefill = sum(seq.num_scheduled_tokens for seq in seqs) - num_decode
        step = self._launch(seqs, num_prefill, num_decode) if seqs else None
        if self._in_flight is not None:
            finished += self._complete(self._in_flight)
        self._in_flight = step
        if step is not None:
            for row, seq in enumerate(step.sampled):
                if not seq.is_finished:  # one that ended meanwhile drops this step's token
                    seq.append_pending(row)
            if not self.config.async_scheduling:
                finished += self._complete(step)
                self._in_flight = None
        return finished, num_prefill, num_decode

    def _launch(self, seqs: list[Sequence], num_prefill: int, num_decode: int) -> "Step":
        sampled = [seq for seq in seqs if seq.samples_this_step]
        output = self.model_runner.run(seqs)
        return Step(sampled, self.scheduler.launched(seqs), output, num_prefill, num_decode, perf_counter())

    def _complete(self, step: "Step") -> list[Sequence]:
        token_ids, logprobs = step.output.result()
        # a worker that died during the step leaves garbage behind: no handle gets it (the watch has failed the
        # loop before it aborts the collectives that free this step)
        self._loop.check()
        # a step's time: since the step before it completed (steps overlap), or since its launch after a pause
        now = perf_counter()
        elapsed, self._last_completed = max(now - max(self._last_completed, step.launched_at), 1e-6), now
        kind, num_tokens = ("Prefill", step.num_prefill) if step.num_prefill else ("Decode", step.num_decode)
        self._throughput[kind] = f"{int(num_tokens / elapsed)}tok/s"
        took, finished = self.scheduler.complete(step.sampled, step.filled, token_ids, logprobs)
        handles = self._loop.handles
        for seq in took:
            handle = handles.get(seq.seq_id)
            try:
                stopped = handle is not None and handle._on_token(seq.last_token)
            except Exception as error:  # (detokenizing its token, its stop strings) it fails alone
                self._fail_request(handle, error)
                continue
            if stopped:  # a stop string ended it
                if seq.is_finished:
                    seq.finish_reason = "stop"
                else:
                    self.scheduler.finish(seq, "stop")
                    finished.append(seq)
        for seq in finished:
            self._loop.keep_for_step(handles.get(seq.seq_id))  # before it leaves the table, for is_finished()
            handle = handles.pop(seq.seq_id, None)  # (None: failed above, or a close() in another thread)
            if handle is not None:
                try:
                    handle._on_finish()
                except Exception as error:  # (making its output) it fails alone too
                    self._fail_request(handle, error)
        return finished

    def _fail_request(self, handle: RequestHandle, error: Exception):
        """A request whose own bookkeeping raised fails with the error, and its blocks are freed; the others in
        the step go on (an error in the step itself fails them all: `_step`)."""
        self._loop.handles.pop(handle.request_id, None)
        if not handle.seq.is_finished:
            self.scheduler.abort(handle.seq)
        handle.failed_alone = True
        handle._on_error(error)

    # ---- offline batches ----
    def generate(self, prompts: list[Prompt] | Prompt,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[dict]:
        """One output dict per prompt, in prompt order. `prompts` is a prompt (a str, or a list of token ids)
        or a list of them; `sampling_params` is one SamplingParams for all or one per prompt. `use_tqdm`: a
        progress bar on stderr (None: only when stderr is a terminal)."""
        prompts = prompt_list(prompts)
        params = [self._check_params(p) for p in params_list(sampling_params, len(prompts))]
        token_ids = [self.encode(prompt) for prompt in prompts]  # every prompt is checked before any runs
        if not token_ids:
            return []
        if use_tqdm is None:
            use_tqdm = sys.stderr.isatty()
        handles = self._submit(token_ids, params, stream=False)
        try:  # (at once: a ^C from here on aborts the requests)
            with tqdm(total=len(handles), desc="Generating", dynamic_ncols=True, disable=not use_tqdm) as pbar:
                for handle in handles:
                    while not handle._done.wait(0.1):
                        pbar.set_postfix(self._throughput, refresh=False)
                        pbar.update(sum(h.finished for h in handles) - pbar.n)
                pbar.update(len(handles) - pbar.n)
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
            return SamplingParams(**self.sampling_defaults)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, not {type(params).__name__}"
                            + (" (SamplingParams(**d) makes one from a dict)" if isinstance(params, dict) else ""))
        vocab_size = self.config.hf_config.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        if params.logprobs is not None and params.logprobs > vocab_size:
            raise ValueError(f"logprobs={params.logprobs} is more than the vocabulary size {vocab_size}")
        # a copy, checked again: later changes to the caller's object change no request (vLLM clones it too)
        return replace(params)


@dataclass(slots=True)
class Step:
    """A launched step: the sequences that sample (in the order of its tokens), what the scheduler needs to
    complete it, and rank 0's output on its way to the host."""
    sampled: list[Sequence]
    filled: list[tuple]
    output: StepOutput
    num_prefill: int
    num_decode: int
    launched_at: float


def token_id_list(values) -> list[int] | None:
    """`values` as Python ints (numpy's too), or None if one is no integer."""
    try:
        token_ids = [operator.index(t) for t in values]
    except TypeError:
        return None
    if any(isinstance(t, (bool, np.bool_)) for t in values):
        return None
    return token_ids


def prompt_list(prompts) -> list:
    """A str or a list of token ids is one prompt (as in vLLM)."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, np.ndarray) and prompts.ndim == 1:
        return [prompts]
    if isinstance(prompts, (list, tuple, np.ndarray)):
        if len(prompts) and token_id_list(prompts) is not None:
            return [prompts]
        return list(prompts)
    hint = " (pass list(...) of it)" if hasattr(prompts, "__next__") else ""
    raise TypeError(f"prompts must be a str, a list of token ids, or a list of such prompts, not "
                    f"{type(prompts).__name__}{hint}")


def params_list(sampling_params, num_prompts: int) -> list:
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if not isinstance(sampling_params, (list, tuple)):
        hint = " (SamplingParams(**d) makes one from a dict)" if isinstance(sampling_params, dict) else ""
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them (one per prompt), not "
                        f"{type(sampling_params).__name__}{hint}")
    if len(sampling_params) != num_prompts:
        raise ValueError(f"{len(sampling_params)} sampling params were given for {num_prompts} prompts; "
                         "give one, or one per prompt")
    return list(sampling_params)


def generation_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        try:
            config = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a {type(config).__name__}, not a JSON object")
    return config


def eos_token_ids(model_dir: str, tokenizer) -> tuple[int, ...]:
    ids = set() if tokenizer.eos_token_id is None else {tokenizer.eos_token_id}
    extra = generation_config(model_dir).get("eos_token_id")
    extra = [] if extra is None else [extra] if isinstance(extra, int) else extra
    if not isinstance(extra, list) or not all(type(i) is int and i >= 0 for i in extra):
        raise ValueError(f"{model_dir}/generation_config.json: eos_token_id={extra!r} must be a token id or a list")
    return tuple(sorted(ids.union(extra)))


def sampling_defaults(model_dir: str) -> dict:
    """The sampling fields that vLLM takes from generation_config.json for what a request leaves out."""
    config = generation_config(model_dir)
    names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    defaults = {name: config[name] for name in names if config.get(name) is not None}
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{model_dir}/generation_config.json: {e}") from e
    return defaults
