"""Where a decode step's time goes on CUDA: wall time per step, and the top kernels from torch.profiler.

    python benchmarks/profile_decode.py [--model PATH] [--batch 256] [--context 1000] [--steps 20]
"""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from nanovllm import LLM, SamplingParams
from nanovllm.engine.sequence import Sequence
from nanovllm.utils.random_checkpoint import default_checkpoint


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()

    llm = LLM(args.model or str(default_checkpoint("qwen3-0.6b")), enforce_eager=args.enforce_eager)
    scheduler = llm.scheduler
    params = SamplingParams(temperature=0.6, max_tokens=10 ** 6, ignore_eos=True)
    for i in range(args.batch):
        scheduler.add(Sequence([(i * 7 + j) % 10000 for j in range(args.context)], params))
    while scheduler.waiting or any(s.num_tokens - s.num_computed_tokens > 1 for s in scheduler.running):
        llm.step()  # prefill
    for _ in range(5):
        llm.step()
    torch.cuda.synchronize()

    phases = {"schedule": 0.0, "run (incl. GPU wait)": 0.0, "postprocess": 0.0}
    t_start = time.perf_counter()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        seqs = scheduler.schedule()
        t1 = time.perf_counter()
        tokens, _ = llm.model_runner.run(seqs).result()
        t2 = time.perf_counter()
        scheduler.postprocess(seqs, tokens)
        t3 = time.perf_counter()
        phases["schedule"] += t1 - t0
        phases["run (incl. GPU wait)"] += t2 - t1
        phases["postprocess"] += t3 - t2
    per_step = (time.perf_counter() - t_start) / args.steps
    print(f"batch {args.batch}, context ~{args.context}: {per_step * 1e3:.2f} ms/step, "
          f"{args.batch / per_step:.0f} tok/s; " + ", ".join(f"{k} {v / args.steps * 1e3:.2f} ms" for k, v in phases.items()))

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            llm.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=70))


if __name__ == "__main__":
    main()
