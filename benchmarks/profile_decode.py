"""Where a decode step's time goes on CUDA: wall time per step, the top kernels from torch.profiler, and how long
the GPU sits idle between steps (the host gap that overlap scheduling should hide).

    python benchmarks/profile_decode.py [--model PATH] [--batch 256 [16 ...]] [--context 1000] [--steps 20] [--rows 15]

Several batch sizes run one after the other in one engine; a table of ms/step by batch closes the output.

The critical path (`chain`): what each kernel adds to a step's GPU time, where dependent launches make kernels
overlap and their own durations mislead.

Idle time: the profiler's kernel and memcpy records of the timed steps, sorted by start; every gap between the end
of one and the start of the next counts. "gaps > 20 us" are the step boundaries (inside a CUDA graph replay
kernels follow each other within a few microseconds); "idle" is all of it, per step.
"""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from nanovllm import LLM, SamplingParams
from nanovllm.engine.sequence import Sequence
from nanovllm.utils.random_checkpoint import default_checkpoint

STEP_GAP_US = 20.0
WARM_UP_STEPS = 5  # decode steps after the prefill, before the timed ones


def device_records(prof) -> list[tuple[str, float, float]]:
    """(name, start, end) in microseconds of the profiled steps' device records (kernels, copies, memsets)."""
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def device_idle(records: list[tuple[str, float, float]], steps: int) -> str:
    """GPU idle time per step between the device records of the profiled steps."""
    spans = sorted((start, end) for _, start, end in records)
    if len(spans) < 2:
        return "no device records"
    gaps, end = [], spans[0][1]
    for start, stop in spans[1:]:
        gaps.append(max(0.0, start - end))
        end = max(end, stop)
    big = [g for g in gaps if g > STEP_GAP_US]
    busy = sum(stop - start for start, stop in spans)
    return (f"device records {len(spans) / steps:.0f}/step, busy {busy / steps / 1e3:.3f} ms/step (summed), idle "
            f"{sum(gaps) / steps / 1e3:.3f} ms/step; gaps > {STEP_GAP_US:.0f} us: {len(big) / steps:.1f}/step, "
            f"{sum(big) / steps / 1e3:.3f} ms/step, largest {max(gaps) / 1e3:.3f} ms")


def largest_gaps(records: list[tuple[str, float, float]], count: int) -> list[tuple[float, str, str]]:
    """The `count` longest idle gaps of more than STEP_GAP_US between device records (name, start, end), longest
    first: (microseconds, the record that ended last before it, the record after it)."""
    gaps, latest, before = [], None, ""
    for name, start, end in sorted(records, key=lambda record: record[1]):
        if latest is not None and start - latest > STEP_GAP_US:
            gaps.append((start - latest, before, name))
        if latest is None or end > latest:
            latest, before = end, name
    return sorted(gaps, reverse=True)[:count]


def chain(spans: list[tuple[str, float, float]], steps: int) -> list[tuple[str, float, float]]:
    """What each kernel adds to the GPU's critical path, from (name, start, end) records in microseconds: taken in
    order of start, each record moves the latest end seen so far by `end - max(latest, start)`, and a gap before
    it shorter than STEP_GAP_US (idle inside a step) counts to it too. With dependent launches a kernel starts
    long before the one before it ends, so its own duration says little; this says what it costs a step.
    Returns (name, records per step, microseconds per step), the costliest first."""
    adds, count, latest = {}, {}, None
    for name, start, end in sorted(spans, key=lambda span: span[1]):
        name = name.split("<")[0].split("(")[0][:48]
        if latest is None:
            latest = start
        gap = start - latest
        adds[name] = adds.get(name, 0.0) + max(0.0, end - max(latest, start)) + (gap if 0 < gap < STEP_GAP_US else 0)
        count[name] = count.get(name, 0) + 1
        latest = max(latest, end)
    return sorted(((name, count[name] / steps, us / steps) for name, us in adds.items()), key=lambda row: -row[2])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--batch", type=int, nargs="+", default=[256])
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--rows", type=int, default=15, help="kernels listed")
    parser.add_argument("--trace", help="a file: write a Chrome trace of the profiled steps")
    args = parser.parse_args()

    start = time.perf_counter()
    llm = LLM(args.model or str(default_checkpoint("qwen3-0.6b")), enforce_eager=args.enforce_eager,
              kv_cache_dtype=args.kv_cache_dtype)
    print(f"engine ready in {time.perf_counter() - start:.1f} s", flush=True)
    results = [profile_batch(llm, batch, args) for batch in args.batch]
    print("| batch | context | ms/step | tok/s |\n| ---: | ---: | ---: | ---: |")
    for batch, per_step in zip(args.batch, results):
        print(f"| {batch} | {args.context} | {per_step * 1e3:.3f} | {batch / per_step:.0f} |")


def profile_batch(llm, batch: int, args) -> float:
    """Seconds per decode step of `batch` sequences of ~args.context tokens, with a kernel table; the sequences
    finish before it returns."""
    begin = time.perf_counter()
    scheduler = llm.scheduler
    # a sequence prefilled early decodes in every later prefill step: its length must outlast those steps, the
    # warm-up, the timed and the profiled steps, or the profiled batch is smaller than `batch`
    budget = llm.config.max_num_batched_tokens - batch  # (a mixed step's decodes take part of its token budget)
    prefill_steps = -(-batch * args.context // max(budget, 1)) + 2
    params = SamplingParams(temperature=0.6, max_tokens=prefill_steps + WARM_UP_STEPS + 2 * args.steps + 2,
                            ignore_eos=True)
    for i in range(batch):
        scheduler.add(Sequence([(i * 7 + j) % 10000 for j in range(args.context)], params))
    while scheduler.waiting or any(s.num_tokens - s.num_computed_tokens > 1 for s in scheduler.running):
        llm.step()  # prefill
    for _ in range(WARM_UP_STEPS):
        llm.step()
    torch.cuda.synchronize()

    start = time.perf_counter()
    for _ in range(args.steps):
        llm.step()
    torch.cuda.synchronize()
    per_step = (time.perf_counter() - start) / args.steps
    print(f"batch {batch}, context ~{args.context}: {per_step * 1e3:.3f} ms/step, {batch / per_step:.0f} tok/s")
    assert len(scheduler.running) == batch, f"{len(scheduler.running)} of {batch} sequences still running"

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            llm.step()
        torch.cuda.synchronize()
        profiled = (time.perf_counter() - start) / args.steps
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=70))
    records = device_records(prof)
    print(device_idle(records, args.steps))
    print("| kernel | per step | adds to the critical path, us/step |\n| --- | ---: | ---: |")
    for name, count, us in chain(records, args.steps)[:args.rows]:  # (not per_step: that is returned below)
        print(f"| {name} | {count:.0f} | {us:.1f} |")
    print(f"profiled steps: {profiled * 1e3:.3f} ms/step of wall time")
    assert len(scheduler.running) == batch, f"{len(scheduler.running)} of {batch} sequences still running"
    if args.trace:
        prof.export_chrome_trace(f"{args.trace}.{batch}.json" if len(args.batch) > 1 else args.trace)
    while not scheduler.is_finished():
        llm.step()
    print(f"batch {batch} done in {time.perf_counter() - begin:.1f} s", flush=True)
    return per_step


if __name__ == "__main__":
    main()
