"""Where a mixed step's time goes on CUDA: `--decodes` sequences decode while one prompt of each `--prompt-lens`
arrives; for each length, the wall time of the step that prefills it beside the decodes (async scheduling off,
so a step's time is its own), of a decode-only step, and of the same prompt prefilled alone, and the GPU time of
the mixed step and of its attention, and of the prompt alone (on CUDA; what the kernels add to the critical path,
since under dependent launch a kernel starts while the one before it ends, so the profiler's durations overlap).
Choose lengths whose mixed step takes the graph size of the prompt alone (300, 500, 900 beside 6 decodes), or the
difference counts padding too. Then, for the last
length, its kernels by their own time (torch.profiler) and the host functions that took longest (cProfile): a
step whose wall time is far above its GPU time is bound by the host.

    python benchmarks/profile_mixed.py [--model PATH] [--decodes 8] [--context 500] [--prompt-lens 16 128 512 1024]
"""
import argparse
import contextlib
import cProfile
import pstats
import random
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from profile_decode import chain  # (this folder: python puts a script's own folder on the path)
from nanovllm import LLM, SamplingParams
from nanovllm.utils.random_checkpoint import default_checkpoint


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_step(llm: LLM) -> float:
    sync()
    start = time.perf_counter()
    llm.step()
    sync()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--decodes", type=int, default=8)
    parser.add_argument("--context", type=int, default=500)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[16, 128, 512, 1024])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--trace", help="a folder: write a Chrome trace of three mixed steps per prompt length")
    args = parser.parse_args()
    rng = random.Random(0)

    start = time.perf_counter()
    llm = LLM(args.model or str(default_checkpoint("qwen3-0.6b" if torch.cuda.is_available() else "tiny")),
              async_scheduling=False)
    print(f"engine ready in {time.perf_counter() - start:.1f} s")
    vocab = min(llm.tokenizer.vocab_size, 10000)

    def prompt(n):
        return [rng.randrange(vocab) for _ in range(n)]
    forever = SamplingParams(temperature=0.6, max_tokens=10 ** 6, ignore_eos=True)
    once = SamplingParams(temperature=0.6, max_tokens=1, ignore_eos=True)
    for _ in range(args.decodes):
        llm.add_request(prompt(args.context), forever)
    for _ in range(3):
        llm.step()  # the prefill, then decodes
    print(f"{args.decodes} decodes of ~{args.context} tokens; ms per step, median of {args.reps}")
    print("| prompt tokens | mixed step | decode-only step | prefill alone | mixed step: GPU | its attention, "
          "us a layer | prefill alone: GPU | its attention |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in args.prompt_lens:
        mixed, decode = [], []
        for _ in range(args.reps):
            llm.add_request(prompt(n), once)
            mixed.append(timed_step(llm))
            decode.append(timed_step(llm))
        with decodes_held(llm):
            alone = []
            for _ in range(args.reps):
                llm.add_request(prompt(n), once)
                alone.append(timed_step(llm))
            alone_gpu, alone_attention = gpu_time(llm, n, once, args.reps, prompt)
        gpu, attention = gpu_time(llm, n, once, args.reps, prompt)
        print(f"| {n} | {statistics.median(mixed) * 1e3:.2f} | {statistics.median(decode) * 1e3:.2f} | "
              f"{statistics.median(alone) * 1e3:.2f} | {gpu:.2f} | {attention:.1f} | {alone_gpu:.2f} | "
              f"{alone_attention:.1f} |")

    if args.trace:
        for n in args.prompt_lens:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    llm.add_request(prompt(n), once)
                    timed_step(llm)
            prof.export_chrome_trace(f"{args.trace}/mixed_{n}.json")
    n = args.prompt_lens[-1]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.reps):
            llm.add_request(prompt(n), once)
            timed_step(llm)
    records = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"\nmixed steps with {n} prompt tokens: {records / args.reps:.0f} device records/step")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.reps):
        llm.add_request(prompt(n), once)
        timed_step(llm)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


ATTENTION_KERNELS = ("_attention_kernel", "_merge_splits_kernel", "flash")  # Triton's two, flash-attn-4's


def gpu_time(llm: LLM, n: int, params, reps: int, prompt) -> tuple[float, float]:
    """ms of GPU time per mixed step of an n-token prompt beside the decodes, and us per layer of its attention
    kernels: what they add to the critical path (`profile_decode.chain`; 0 without CUDA)."""
    with profile(activities=[ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            llm.add_request(prompt(n), params)
            timed_step(llm)
    rows = chain([(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA], reps)
    attention = sum(us for name, _, us in rows if any(k in name for k in ATTENTION_KERNELS))
    return sum(us for *_, us in rows) / 1e3, attention / len(llm.model_runner.attn_layers)


@contextlib.contextmanager
def decodes_held(llm: LLM):
    """Steps inside prefill the prompts added there with no decode beside them: the decodes are held back (a
    scratch engine would recompile)."""
    scheduler = llm.scheduler
    held = list(scheduler.running)
    scheduler.running.clear()
    try:
        yield
    finally:
        assert not scheduler.running  # (each prompt there finishes in its own step: max_tokens=1)
        scheduler.running.extend(held)


if __name__ == "__main__":
    main()
