"""Latency under Poisson arrivals, mixed steps vs nano-vllm's prefill-first steps.

Requests arrive at `--rate` per second (exponential gaps, seed 0) with prompt lengths uniform in 100..1024 and
output lengths uniform in 100..`--max-output-len` (or all of it, when that is below 100); each is streamed with `LLM.stream`. Reports time to first
token (TTFT) and inter-token latency (ITL), p50 and p99, for each policy. Below the table, for each policy: the
slowest steps of the timed run (wall time, prefill and decode tokens), and how many kernels compiled during it
(flash-attn-4's cache of compiled kernels, torch.compile's frames, and Triton's compile hook, which names them)
and the longest garbage collection: a tail that comes from a compile or a collection mid-serving shows there.

    python benchmarks/latency.py [--model PATH] [--num-requests 200] [--rate 20] [--budgets 512 2048 16384]

`--budgets`: the token budgets (`max_num_batched_tokens`) of the mixed steps to compare; a smaller one cuts the
long prompts into more chunks, so decodes beside them wait less and first tokens come later.
"""
import argparse
import asyncio
import gc
import random
import statistics
import time

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config

DEFAULT_BUDGET = Config.default("max_num_batched_tokens")
from nanovllm.utils.random_checkpoint import default_checkpoint


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


async def one_request(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[float, list[float], float]:
    start = time.perf_counter()
    times = [time.perf_counter() async for _ in llm.stream(prompt, params)]
    return times[0] - start, [b - a for a, b in zip(times, times[1:])], start


async def drive(llm: LLM, requests, rate: float, seed: int):
    rng = random.Random(seed)
    tasks = []
    for prompt, params in requests:
        tasks.append(asyncio.create_task(one_request(llm, prompt, params)))
        await asyncio.sleep(rng.expovariate(rate))
    return await asyncio.gather(*tasks)


TRITON_COMPILES: list[str] = []  # the Triton kernels this process compiled (or loaded from Triton's disk cache)


def watch_triton_compiles():
    """Record each Triton kernel variant as it is compiled; Triton without the hook (before 3.4) records none."""
    try:
        from triton import knobs
        knobs.runtime.jit_post_compile_hook = lambda *, fn, **_: TRITON_COMPILES.append(fn.name)
    except Exception:
        pass


GC_PAUSES: list[tuple[float, int]] = []  # (seconds, generation) of every garbage collection in this process


def watch_garbage_collections():
    started = []

    def callback(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            GC_PAUSES.append((time.perf_counter() - started.pop(), info["generation"]))
    gc.callbacks.append(callback)


def compiled_kernels() -> int:
    """Kernels compiled so far in this process by flash-attn-4, torch.compile and Triton (what can compile
    mid-serving)."""
    count = len(TRITON_COMPILES)
    try:
        from flash_attn.cute import interface
        cache = interface._flash_attn_fwd.compile_cache
        count += len(getattr(cache, "cache", cache))  # 4.0.0b36's JITCache has no len(): its dict is .cache
    except Exception:  # flash-attn-4 is not installed, or keeps its cache elsewhere
        pass
    from torch._dynamo.utils import counters
    return count + counters["stats"]["unique_graphs"]


def trace_steps(llm: LLM) -> list:
    """Records (wall s, prefill tokens, decode tokens) of every step the engine's loop takes from now on."""
    steps, step = [], llm._step

    def timed():
        start = time.perf_counter()
        result = step()
        steps.append((time.perf_counter() - start, result[1], result[2]))
        return result
    llm._step = timed
    return steps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second")
    parser.add_argument("--max-output-len", type=int, default=512)
    parser.add_argument("--budgets", type=int, nargs="+", default=[DEFAULT_BUDGET],
                        help="token budgets of the mixed steps (max_num_batched_tokens), each its own run")
    args = parser.parse_args()
    watch_triton_compiles()
    watch_garbage_collections()
    path = args.model or str(default_checkpoint("qwen3-0.6b" if torch.cuda.is_available() else "tiny"))

    rng = random.Random(0)
    vocab = 512 if "tiny" in path else 10000
    requests = [([rng.randrange(vocab) for _ in range(rng.randint(100, 1024))],
                 SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(min(100, args.max_output_len), args.max_output_len)))
                for _ in range(args.num_requests)]
    rows, notes = [], []
    policies = [(f"mixed, budget {b}" if len(args.budgets) > 1 else "mixed", False, b) for b in args.budgets]
    for name, prefill_first, budget in [*policies, ("prefill-first", True, DEFAULT_BUDGET)]:
        with LLM(path, prefill_first=prefill_first, max_num_batched_tokens=budget) as llm:
            # a short burst first: every kind of step has run (and compiled) before the clock starts
            warmup = [(prompt, SamplingParams(max_tokens=8, ignore_eos=True)) for prompt, _ in requests[:16]]
            asyncio.run(drive(llm, warmup, 4 * args.rate, seed=1))
            compiled, triton_before, steps = compiled_kernels(), len(TRITON_COMPILES), trace_steps(llm)
            gc_before = len(GC_PAUSES)
            t = time.perf_counter()
            results = asyncio.run(drive(llm, requests, args.rate, seed=0))
            elapsed = time.perf_counter() - t
            compiled = compiled_kernels() - compiled
            triton_names = sorted(set(TRITON_COMPILES[triton_before:]))
            pauses = GC_PAUSES[gc_before:]
        ttft = [r[0] for r in results]
        itl = [gap for r in results for gap in r[1]]
        tokens = sum(len(r[1]) + 1 for r in results)
        rows.append((name, percentile(ttft, 50), percentile(ttft, 99), percentile(itl, 50), percentile(itl, 99),
                     tokens / elapsed))
        slowest = sorted(steps, reverse=True)[:5]
        notes.append(f"{name}: {len(steps)} steps, {compiled} kernels compiled during the run"
                     + (f" (Triton: {', '.join(triton_names)})" if triton_names else "")
                     + f", {len(pauses)} garbage collections, the longest "
                     + ("%.1f ms (generation %d)" % (max(pauses)[0] * 1e3, max(pauses)[1]) if pauses else "-")
                     + "; slowest steps (ms, prefill tokens, decode tokens): " +
                     ", ".join(f"({s * 1e3:.0f}, {p}, {d})" for s, p, d in slowest))
        with_prefill = [s for s, p, _ in steps if p]
        decode_only = [s for s, p, d in steps if not p and d]
        notes.append(f"{name}: step ms p50 / p90 / p99: " + "; ".join(
            f"{kind} ({len(times)}) " + " / ".join(f"{percentile(times, q) * 1e3:.1f}" for q in (50, 90, 99))
            for kind, times in (("with prefill", with_prefill), ("decode-only", decode_only)) if times))
        late = sorted(zip(results, requests), key=lambda x: -x[0][0])[:5]
        notes.append(f"{name}: slowest first tokens (ms, arrival s, prompt tokens, output tokens): " +
                     ", ".join(f"({r[0] * 1e3:.0f}, {r[2] - t:.2f}, {len(p)}, {len(r[1]) + 1})"
                               for r, (p, _) in late))
    print(f"{args.num_requests} requests at {args.rate}/s")
    print("| steps | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | output tok/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, t50, t99, i50, i99, tps in rows:
        print(f"| {name} | {t50 * 1e3:.1f} ms | {t99 * 1e3:.1f} ms | {i50 * 1e3:.1f} ms | {i99 * 1e3:.1f} ms | {tps:.0f} |")
    print("\n".join(notes))


if __name__ == "__main__":
    main()
