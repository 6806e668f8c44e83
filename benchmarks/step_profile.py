"""bench.py's workload step by step on CUDA: each step's wall time, its prefill and decode tokens, and the bytes a
decode step must read (the weights once plus every running sequence's KV), against the bandwidth of a device copy
measured in the same run (`decode_attention.copy_bandwidth`). The method of `../shared/gpu/step_profile.py`
(which wraps `LLM.step`; `generate` runs `LLMEngine._step`, wrapped here).

    python benchmarks/step_profile.py [--num-seqs 256] [--kv-cache-dtype auto] [--profile-steps 10]
        [--gpu-memory-utilization 0.9]

--profile-steps N: torch.profiler over the run's first N steps (bench.py's prompts go in its first 9): the GPU's idle
time between them and its largest gaps (the host late: what ran before and after each), and what each kernel adds to
the critical path (`profile_decode.chain`).

With overlap scheduling a step's time is from its launch to the end of the call that also completed the step
before it: the sum over steps is the run's time less the loop's own work."""
import argparse
import time
from random import randint, seed

import torch
from torch.profiler import ProfilerActivity, profile

from decode_attention import copy_bandwidth  # (this folder: python puts a script's own folder on the path)
from profile_decode import chain, device_idle, device_records, largest_gaps
from nanovllm import LLM, SamplingParams
from nanovllm.utils.random_checkpoint import default_checkpoint

BATCHES = ((1, 32), (33, 64), (65, 128), (129, 192), (193, 256), (257, 1 << 20))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--profile-steps", type=int, default=0, help="profile the first N steps (0: none)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    llm = LLM(str(default_checkpoint("qwen3-0.6b")), max_model_len=4096, kv_cache_dtype=args.kv_cache_dtype,
              gpu_memory_utilization=args.gpu_memory_utilization)
    seed(0)  # bench.py's prompts and lengths
    prompts = [[randint(0, 10000) for _ in range(randint(100, 1024))] for _ in range(args.num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=randint(100, 1024))
              for _ in range(args.num_seqs)]
    llm.generate(["warm"], SamplingParams(), use_tqdm=False)
    records = []  # (prefill tokens, decode tokens, seconds, tokens in the running sequences)
    step = llm._step
    prof = profile(activities=[ProfilerActivity.CUDA]) if args.profile_steps else None

    def timed_step():
        context = sum(seq.num_tokens for seq in llm.scheduler.running)
        if prof is not None and not records:
            prof.start()
        start = time.perf_counter()
        result = step()
        records.append((result[1], result[2], time.perf_counter() - start, context))
        if prof is not None and len(records) == args.profile_steps:
            torch.cuda.synchronize()
            prof.stop()
        return result
    llm._step = timed_step
    before = torch.cuda.memory_stats()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    total = time.perf_counter() - start
    after = torch.cuda.memory_stats()
    runner = llm.model_runner
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv_per_token = runner.kv_cache[:, :, 0, 0].numel() * runner.kv_cache.element_size()  # all layers, K and V
    in_steps = sum(r[2] for r in records)
    prefill = [r for r in records if r[0]]
    decode = [r for r in records if not r[0]]
    print(f"copy {bandwidth:.2f} TB/s; weights {weights / 1e9:.2f} GB; KV {kv_per_token} B/token; "
          f"total {total:.2f} s, {len(records)} steps, {in_steps:.2f} s in steps")
    print(allocator_line(before, after))
    print(f"steps with prefill: {len(prefill)}, {sum(r[2] for r in prefill):.2f} s, "
          f"{sum(r[0] for r in prefill)} prefill tokens, {sum(r[1] for r in prefill)} decode tokens")
    print("| decode batch | steps | time s | ms/step | floor ms/step | % of floor |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for lo, hi in BATCHES:
        rows = [r for r in decode if lo <= r[1] <= hi]
        if rows:
            seconds = sum(r[2] for r in rows)
            floor = sum(weights + r[3] * kv_per_token for r in rows) / bandwidth / 1e12
            print(f"| {lo}-{hi} | {len(rows)} | {seconds:.2f} | {seconds / len(rows) * 1e3:.2f} | "
                  f"{floor / len(rows) * 1e3:.2f} | {floor / seconds:.0%} |")
    seconds = sum(r[2] for r in decode)
    floor = sum(weights + r[3] * kv_per_token for r in decode) / bandwidth / 1e12
    print(f"decode-only: {len(decode)} steps, {seconds:.2f} s, floor {floor:.2f} s ({floor / seconds:.0%} of floor)")
    if prof is not None:
        print_profile(device_records(prof), args.profile_steps, records[:args.profile_steps])


def allocator_line(before: dict, after: dict) -> str:
    """What the caching allocator did in the run: each retry (a malloc that failed, then freed the cached blocks and
    tried again) and each cudaFree synchronizes the device, leaving the GPU idle while the host catches up."""
    delta = {key: after.get(key, 0) - before.get(key, 0) for key in ("num_alloc_retries", "num_device_alloc",
                                                                     "num_device_free", "num_ooms")}
    return (f"allocator in the run: {delta['num_alloc_retries']} retries, {delta['num_device_alloc']} cudaMalloc, "
            f"{delta['num_device_free']} cudaFree, {delta['num_ooms']} OOMs; reserved "
            f"{after['reserved_bytes.all.current'] / 2**30:.1f} GiB "
            f"(peak {after['reserved_bytes.all.peak'] / 2**30:.1f}), "
            f"allocated peak "
            f"{after['allocated_bytes.all.peak'] / 2**30:.1f} GiB of {torch.cuda.mem_get_info()[1] / 2**30:.1f}")


def print_profile(spans: list[tuple[str, float, float]], steps: int, records: list[tuple]):
    """The profiled steps: their wall times, the GPU's idle time and largest gaps, the critical path's kernels."""
    print(f"first {steps} steps, (prefill tokens, decode tokens, ms):",
          [(r[0], r[1], round(r[2] * 1e3, 1)) for r in records])
    print(device_idle(spans, steps))
    for gap, before, after in largest_gaps(spans, 8):
        print(f"  idle {gap / 1e3:.2f} ms after {before[:40]} before {after[:40]}")
    for name, count, us in chain(spans, steps)[:12]:
        print(f"  {us / 1e3:8.3f} ms/step {count:6.1f}/step  {name}")


if __name__ == "__main__":
    main()
