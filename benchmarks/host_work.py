"""Host work per call that could grow with the size of the KV cache or of a request's history (issue 10,
item 4), timed on CPU:
(a) `BlockManager.allocate` for a 2,049-token prompt: a hit on a cached 2,048-token prefix whose blocks sit at
    the end of the free list (where freed blocks go), a miss, and a retry that does not fit (a waiting
    prompt is retried at every step until it fits);
(b) what a request handle costs per sampled token: on the loop thread (`_on_token`), and for a reader who
    iterates it, with the number of tokenizer decodes per token;
(c) a sampling step of 256 sequences of 2,000 tokens (1,000 prompt, 1,000 output) over Qwen3's vocabulary:
    the build of the sampling batch and the sampler, plain temperature rows vs penalized ones (the penalties
    must not cost a pass over every sequence's history at every step);
(d) what a tensor-parallel decode step of 256 sequences (contexts 100..1024) costs the channel: rank 0 pickles
    the step's arrays (`StepInputs`), a worker unpickles them (posting the `Sequence`s cost 10-30x as much).

    python benchmarks/host_work.py [--blocks 4400 131072] [--repeat 50] [--tokens 2000] [--steps 5]
        [--num-seqs 256]

(Run it from the repository root with PYTHONPATH=. to time this checkout rather than an installed copy.)
"""
import argparse
import asyncio
import gc
import pickle
import random
import statistics
import threading
import time
from types import SimpleNamespace

import torch
from transformers import AutoTokenizer

from nanovllm import SamplingParams
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.penalty_slots import PenaltySlots
from nanovllm.engine.request import RequestHandle
from nanovllm.engine.sampling_batch import build_sampling_batch
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step_inputs import step_inputs
from nanovllm.layers.sampler import Sampler
from nanovllm.utils.random_checkpoint import default_checkpoint

BLOCK_SIZE = 16
PREFIX = 2048
VOCAB = 151936  # Qwen3's


def median_ms(timings: list[float]) -> float:
    return statistics.median(timings) * 1e3


def allocate_row(num_blocks: int, repeat: int, rng: random.Random) -> dict:
    def prompt(length: int) -> list[int]:
        return [rng.randrange(151936) for _ in range(length)]

    def cache_prefix(bm: BlockManager, tokens: list[int]) -> Sequence:
        seq = Sequence(tokens)
        assert bm.allocate(seq)
        seq.num_computed_tokens = PREFIX
        bm.hash_computed_blocks(seq, 0)
        return seq

    def timed_allocate(bm: BlockManager, seq: Sequence) -> tuple[bool, float]:
        start = time.perf_counter()
        fits = bm.allocate(seq)
        return fits, time.perf_counter() - start

    cached = prompt(PREFIX + 1)
    hit, miss, retry = [], [], []
    bm = BlockManager(num_blocks, BLOCK_SIZE)
    bm.deallocate(cache_prefix(bm, cached))  # its blocks keep their hashes, at the end of the free list
    for _ in range(repeat):
        seq = Sequence(cached)  # a new request: nothing about it is known yet
        fits, seconds = timed_allocate(bm, seq)
        assert fits and seq.num_cached_tokens == PREFIX
        hit.append(seconds)
        bm.deallocate(seq)
    bm = BlockManager(num_blocks, BLOCK_SIZE)
    for _ in range(repeat):
        seq = Sequence(prompt(PREFIX + 1))
        fits, seconds = timed_allocate(bm, seq)
        assert fits and seq.num_cached_tokens == 0
        miss.append(seconds)
        bm.deallocate(seq)
    # a running request holds the prefix, another fills the cache; a longer prompt with the same prefix waits
    bm = BlockManager(num_blocks, BLOCK_SIZE)
    cache_prefix(bm, cached)
    assert bm.allocate(Sequence([0] * ((bm.num_free_blocks - 8) * BLOCK_SIZE)))
    waiting = Sequence(cached[:PREFIX] + prompt(PREFIX + 1))
    for _ in range(repeat):
        fits, seconds = timed_allocate(bm, waiting)
        assert not fits
        retry.append(seconds)
    return {"hit": median_ms(hit), "miss": median_ms(miss), "retry": median_ms(retry)}


class Counting:
    """A function, counting its calls."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


def handle_row(tokenizer, how: str, num_tokens: int, rng: random.Random) -> dict:
    """Per token: seconds on the loop thread, seconds in the reader, decodes (the last one's finish excluded)."""
    stop = ["never there"] if how == "stop string" else []
    params = SamplingParams(max_tokens=num_tokens + 1, ignore_eos=True, stop=stop)
    seq = Sequence([rng.randrange(3, 500) for _ in range(200)], params)
    loop = SimpleNamespace(need_progress=lambda: None)
    handle = RequestHandle(loop, tokenizer, threading.Lock(), seq, stream=True)
    handle._detokenizer.decode = counting = Counting(handle._detokenizer.decode)  # the per-token decodes
    event_loop = None
    if how == "asyncio listener":
        event_loop = asyncio.new_event_loop()  # not running: its queue only collects what is sent
        handle._add_listener((event_loop, asyncio.Queue()))
    increments = iter(handle)
    loop_seconds = reader_seconds = 0.0
    for _ in range(num_tokens):
        token_id = rng.randrange(3, 500)
        seq.append_token(token_id)
        start = time.perf_counter()
        handle._on_token(token_id)
        loop_seconds += time.perf_counter() - start
        if how == "iterated":  # a reader that keeps up: it takes each increment as it comes
            start = time.perf_counter()
            next(increments)
            reader_seconds += time.perf_counter() - start
    decodes = counting.calls
    if how == "iterated at the end":  # a reader who comes once the request has finished reads it all
        seq.finish_reason = "length"
        handle._on_finish()
        start = time.perf_counter()
        list(increments)
        reader_seconds += time.perf_counter() - start
    if event_loop is not None:
        event_loop.close()
    return {"loop": loop_seconds / num_tokens * 1e6, "reader": reader_seconds / num_tokens * 1e6,
            "decodes": decodes / num_tokens}


def sampling_step_row(params: SamplingParams, num_seqs: int, num_steps: int, rng: random.Random) -> dict:
    """Median ms of a sampling step on CPU: building the batch, and sampling (up to the tokens on the host)."""
    seqs = []
    for _ in range(num_seqs):
        seq = Sequence([rng.randrange(VOCAB) for _ in range(1000)], params)
        for _ in range(1000):
            seq.append_token(rng.randrange(VOCAB))
        seqs.append(seq)
    logits = torch.randn(num_seqs, VOCAB, generator=torch.Generator().manual_seed(0))
    sampler, generator = Sampler(), torch.Generator().manual_seed(0)
    penalty_slots = PenaltySlots(VOCAB, 4096, num_seqs, torch.device("cpu"))
    build, sample = [], []
    for step in range(num_steps + 1):  # the first one warms up (and builds the penalty slots)
        start = time.perf_counter()
        batch = build_sampling_batch(seqs, frozenset([2]), VOCAB, torch.from_numpy, penalty_slots)
        built = time.perf_counter()
        sampled = sampler.sample(logits, batch, generator)[0]
        if batch.penalties is not None:  # as the model runner does
            penalty_slots.append(batch.penalties, sampled)
        token_ids = sampled.tolist()
        done = time.perf_counter()
        if step:
            build.append(built - start)
            sample.append(done - built)
        for seq, token_id in zip(seqs, token_ids):
            seq.append_token(token_id)
    return {"build": median_ms(build), "sample": median_ms(sample)}


def channel_row(num_seqs: int, repeat: int, rng: random.Random) -> tuple[float, float, int]:
    """Median us per decode step to pickle and to unpickle its `StepInputs`, and their bytes."""
    seqs = []
    for i in range(num_seqs):
        seq = Sequence([rng.randrange(VOCAB) for _ in range(rng.randint(100, 1024))], SamplingParams())
        seq.block_table = list(range(i * 8, i * 8 + seq.num_tokens // 256 + 1))
        seq.num_computed_tokens, seq.num_scheduled_tokens = seq.num_tokens - 1, 1
        seqs.append(seq)

    def us(fn) -> float:
        timings = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            timings.append(time.perf_counter() - start)
        return statistics.median(timings) * 1e6

    inputs = step_inputs(seqs, 256)  # rank 0 builds them for its own step
    data = pickle.dumps(["run_step", inputs])
    return us(lambda: pickle.dumps(["run_step", inputs])), us(lambda: pickle.loads(data)), len(data)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, nargs="+", default=[4400, 131072])
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--num-seqs", type=int, default=256, help="sequences of the sampling and channel steps")
    args = parser.parse_args()
    rng = random.Random(0)

    print(f"BlockManager.allocate, {PREFIX + 1}-token prompt, blocks of {BLOCK_SIZE}, "
          f"median of {args.repeat} (ms)")
    print(f"{'blocks':>8} | {'prefix hit':>10} | {'miss':>8} | {'retry (no fit)':>14}")
    for num_blocks in args.blocks:
        row = allocate_row(num_blocks, args.repeat, rng)
        print(f"{num_blocks:>8} | {row['hit']:>10.3f} | {row['miss']:>8.3f} | {row['retry']:>14.3f}")

    tokenizer = AutoTokenizer.from_pretrained(default_checkpoint("tiny"))
    # what exists now leaves the collector's sight, as in an engine once it is set up (`ModelRunner`): else a full
    # collection over transformers' and torch's objects lands in whichever row comes first
    gc.collect()
    gc.freeze()
    print(f"\nsubmit handle, per token over {args.tokens} tokens (tiny tokenizer)")
    print(f"{'read by':>22} | {'loop thread us':>14} | {'reader us':>9} | {'decodes/token':>13}")
    for how in ("result() only", "iterated", "iterated at the end", "asyncio listener", "stop string"):
        row = handle_row(tokenizer, how, args.tokens, rng)
        print(f"{how:>22} | {row['loop']:>14.2f} | {row['reader']:>9.2f} | {row['decodes']:>13.2f}")

    print(f"\nsampling step, {args.num_seqs} sequences x 2,000 tokens, vocabulary {VOCAB}, CPU, "
          f"median of {args.steps} (ms)")
    print(f"{'rows':>22} | {'build':>8} | {'sample':>8} | {'step':>8} | {'x plain':>7}")
    plain_ms = None
    all_three = dict(repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1)
    for name, penalties in (("plain", {}), ("repetition", dict(repetition_penalty=1.1)),
                            ("frequency + presence", dict(frequency_penalty=0.2, presence_penalty=0.1)),
                            ("all three", all_three)):
        params = SamplingParams(temperature=0.6, **penalties)
        row = sampling_step_row(params, args.num_seqs, args.steps, rng)
        step_ms = row["build"] + row["sample"]
        plain_ms = plain_ms or step_ms
        print(f"{name:>22} | {row['build']:>8.1f} | {row['sample']:>8.1f} | {step_ms:>8.1f} | "
              f"{step_ms / plain_ms:>7.2f}")

    print(f"\ntensor-parallel channel, a decode step of {args.num_seqs} sequences, median of {args.repeat} (us)")
    post, take, size = channel_row(args.num_seqs, args.repeat, rng)
    print(f"rank 0 pickles {post:.1f}, a worker unpickles {take:.1f}; {size} bytes")
    gc.unfreeze()


if __name__ == "__main__":
    main()
