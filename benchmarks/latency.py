"""Latency under Poisson arrivals, mixed steps vs nano-vllm's prefill-first steps.

Requests arrive at `--rate` per second (exponential gaps, seed 0) with prompt lengths uniform in 100..1024 and
output lengths uniform in 100..`--max-output-len` (or all of it, when that is below 100); each is streamed with `LLM.stream`. Reports time to first
token (TTFT) and inter-token latency (ITL), p50 and p99, for each policy. Below the table, for each policy: the
slowest steps of the timed run (wall time, prefill and decode tokens), and how many kernels compiled during it
(flash-attn-4's cache of compiled kernels, torch.compile's frames, and Triton's compile hook, which names them)
and the longest garbage collection: a tail that comes from a compile or a collection mid-serving shows there.

    python benchmarks/latency.py [--model PATH] [--num-requests 200] [--rate 20] [--budgets 512 2048 16384]

`--budgets`: the token budgets (`max_num_batched_tokens`) of the mixed steps to compare; a smaller one cuts the
long prompts into more chunks, so decodes beside them wait less and first tokens come later. `--policies`: the
runs, in order (default: mixed, then prefill-first); `--policies mixed prefill-first mixed prefill-first` shows
whether a policy's figures depend on its place in the process.
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
from nanovllm.utils.random_checkpoint import default_checkpoint

DEFAULT_BUDGET = Config.default("max_num_batched_tokens")


def make_requests(num_requests: int, max_output_len: int, vocab: int) -> tuple[list, list]:
    """The timed requests (seed 0), and a short burst to run first so that every kind of step has run (and
    compiled) before the clock starts: 16 prompts of the first requests' lengths, other tokens (the timed
    prompts themselves would then hit the prefix cache)."""
    rng = random.Random(0)
    requests = [([rng.randrange(vocab) for _ in range(rng.randint(100, 1024))],
                 SamplingParams(temperature=0.6, ignore_eos=True,
                                max_tokens=rng.randint(min(100, max_output_len), max_output_len)))
                for _ in range(num_requests)]
    warmup = [([rng.randrange(vocab) for _ in prompt], SamplingParams(max_tokens=8, ignore_eos=True))
              for prompt, _ in requests[:16]]
    return requests, warmup


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


def p50_p90(values: list[float]) -> str:
    return f"{percentile(values, 50):.2f} / {percentile(values, 90):.2f}"


def plan_runs(policies: list[str], budgets: list[int]) -> list[tuple[str, bool, int]]:
    """(name, prefill_first, token budget) of each run, in order: a mixed one once per budget; a name that comes
    again is told apart by its run's number."""
    runs, seen = [], {}
    for policy in policies:
        for budget in budgets if policy == "mixed" else [DEFAULT_BUDGET]:
            name = f"mixed, budget {budget}" if policy == "mixed" and len(budgets) > 1 else policy
            seen[name] = seen.get(name, 0) + 1
            runs.append((name + (f" (run {seen[name]})" if seen[name] > 1 else ""), policy == "prefill-first", budget))
    return runs


def trace_prompts(llm: LLM) -> tuple[dict, list]:
    """From now on: by its first 16 tokens, when the step that first computes a prompt began its schedule and when
    its launch returned (perf_counter seconds), so that a request's time to its first token splits into its wait
    for a step (its arrival to that schedule), the host's work to launch it, and the rest (the device's work up to
    the end of that step, and the completion that hands the token over); and on CUDA, events before and after
    every step's launch, with whether it computed prompt tokens (`device_parts`)."""
    prompts, events, schedule, launch = {}, [], llm.scheduler.schedule, llm._launch
    began = [0.0]

    def scheduled():
        began[0] = time.perf_counter()
        return schedule()

    def launched(seqs, *args):
        firsts = [tuple(seq.token_ids[:16]) for seq in seqs if seq.num_scheduled_tokens > 1]
        if torch.cuda.is_available():
            events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), bool(firsts)))
            events[-1][0].record()
        result = launch(seqs, *args)
        if events:
            events[-1][1].record()
        for first in firsts:
            prompts.setdefault(first, (began[0], time.perf_counter()))
        return result
    llm.scheduler.schedule, llm._launch = scheduled, launched
    return prompts, events


def first_token_parts(results, requests, prompts: dict) -> str:
    """Median and p90 of the three parts of `trace_prompts`, over the requests it saw, in ms."""
    parts = [[], [], []]
    for (ttft, _, start), (prompt, _) in zip(results, requests):
        if tuple(prompt[:16]) in prompts:
            scheduled, launched = prompts[tuple(prompt[:16])]
            for part, value in zip(parts, (scheduled - start, launched - scheduled, start + ttft - launched)):
                part.append(value * 1e3)
    names = ("wait for a step", "schedule and launch", "launch to first token")
    return ", ".join(f"{name} {p50_p90(part)}" for name, part in zip(names, parts) if part) + \
        f" ({len(parts[0])} requests)"


def device_parts(events: list) -> str:
    """Median and p90, in ms, of the device's time from the event before a step's launch to the one after it (the
    step's work, once the device reached it), and of its idle time before that event since the step before
    ended, for steps with prompt tokens, the steps after them, and the other steps (the events have completed)."""
    kinds = {"with prompt tokens": [], "after one": [], "other": []}
    for i, (start, end, prompt) in enumerate(events):
        kind = "with prompt tokens" if prompt else "after one" if i and events[i - 1][2] else "other"
        idle = events[i - 1][1].elapsed_time(start) if i else 0.0
        kinds[kind].append((start.elapsed_time(end), max(idle, 0.0)))
    return "; ".join(f"{kind} ({len(pairs)}): work {p50_p90([w for w, _ in pairs])}, idle before "
                     f"{p50_p90([i for _, i in pairs])}" for kind, pairs in kinds.items() if pairs)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second")
    parser.add_argument("--max-output-len", type=int, default=512)
    parser.add_argument("--budgets", type=int, nargs="+", default=[DEFAULT_BUDGET],
                        help="token budgets of the mixed steps (max_num_batched_tokens), each its own run")
    parser.add_argument("--policies", nargs="+", choices=["mixed", "prefill-first"],
                        default=["mixed", "prefill-first"], help="the runs in order (each mixed one once per budget)")
    args = parser.parse_args()
    watch_triton_compiles()
    watch_garbage_collections()
    path = args.model or str(default_checkpoint("qwen3-0.6b" if torch.cuda.is_available() else "tiny"))

    requests, warmup = make_requests(args.num_requests, args.max_output_len, 512 if "tiny" in path else 10000)
    rows, notes = [], []
    for name, prefill_first, budget in plan_runs(args.policies, args.budgets):
        with LLM(path, prefill_first=prefill_first, max_num_batched_tokens=budget) as llm:
            asyncio.run(drive(llm, warmup, 4 * args.rate, seed=1))
            compiled, triton_before, steps = compiled_kernels(), len(TRITON_COMPILES), trace_steps(llm)
            prompts, events = trace_prompts(llm)
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
        notes.append(f"{name}: first tokens, ms p50 / p90: {first_token_parts(results, requests, prompts)}")
        if events:
            torch.cuda.synchronize()
            notes.append(f"{name}: device, ms p50 / p90: {device_parts(events)}")
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
