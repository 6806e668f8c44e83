"""The skinny projections' tiles (`triton_skinny.plan`) timed where they run: in the engine's decode graphs, each
kernel's weights loading during the one before it (dependent launches), not alone as `skinny_gemm.py --sweep`
(git show 34b7da6) timed them. Each variant overrides the plan of some products (o_proj: K 2048, gate/up: gated,
down: K above 2048, in Qwen3-0.6B's shapes) or the decode kernel's L2 prefetch, builds an engine whose graphs
take up to 32 rows, and times decode steps of 1, 8, 16 and 32 sequences of ~1,000 tokens (best of three windows
of 10 steps). The plain plan runs first and last, to show the drift of the run.

    python benchmarks/skinny_plans.py [--kv-cache-dtype auto]
"""
import argparse
import gc
import time

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.sequence import Sequence
from nanovllm.layers import triton_attention, triton_skinny
from nanovllm.utils.random_checkpoint import default_checkpoint

BATCHES = (1, 8, 16, 32)
CONTEXT, WINDOW, WINDOWS = 1000, 10, 3
PLAN, PREFETCH = triton_skinny.plan, triton_attention.KV_PREFETCH_TILES


def overriding(oproj=None, gate_up=None, down=None):
    """triton_skinny.plan with (block_n, block_k, num_warps) of its own for these products."""
    def plan(block_m, k, gated, head_dim=0):
        if not head_dim:
            if gated and gate_up:
                return gate_up
            if not gated and k == 2048 and oproj:
                return oproj
            if not gated and k > 2048 and down:
                return down
        return PLAN(block_m, k, gated, head_dim)
    return plan


VARIANTS = [  # (name, plan, decode L2 prefetch tiles); K in one part where the tile takes it whole
    ("plan", PLAN, PREFETCH),
    ("o_proj 16 x 2048, 8 warps", overriding(oproj=(16, 2048, 8)), PREFETCH),
    ("o_proj 32 x 1024, 8 warps", overriding(oproj=(32, 1024, 8)), PREFETCH),
    ("gate/up 16 x 1024, 8 warps", overriding(gate_up=(16, 1024, 8)), PREFETCH),
    ("down 16 x 1024, 4 warps", overriding(down=(16, 1024, 4)), PREFETCH),
    ("KV prefetch 4 tiles", PLAN, 4),
    ("plan again", PLAN, PREFETCH),
]


def step_ms(llm, batch: int) -> float:
    """Milliseconds a decode step of `batch` sequences of ~CONTEXT tokens; they finish before it returns."""
    scheduler = llm.scheduler
    params = SamplingParams(temperature=0.6, max_tokens=WINDOWS * WINDOW + 20, ignore_eos=True)
    for i in range(batch):
        scheduler.add(Sequence([(i * 7 + j) % 10000 for j in range(CONTEXT)], params))
    while scheduler.waiting or any(s.num_tokens - s.num_computed_tokens > 1 for s in scheduler.running):
        llm.step()  # prefill
    for _ in range(5):
        llm.step()
    best = float("inf")
    for _ in range(WINDOWS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(WINDOW):
            llm.step()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / WINDOW)
    assert len(scheduler.running) == batch, f"{len(scheduler.running)} of {batch} sequences still running"
    while not scheduler.is_finished():
        llm.step()
    return best * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args()
    path, rows = str(default_checkpoint("qwen3-0.6b")), []
    for name, plan, prefetch in VARIANTS:
        triton_skinny.plan, triton_attention.KV_PREFETCH_TILES = plan, prefetch
        llm = LLM(path, max_num_seqs=32, max_model_len=2048, gpu_memory_utilization=0.3,
                  kv_cache_dtype=args.kv_cache_dtype)
        rows.append((name, [step_ms(llm, batch) for batch in BATCHES]))
        print(name, " ".join(f"{ms:.3f}" for ms in rows[-1][1]), flush=True)
        llm.close()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()  # the next engine sizes its cache by this process's peak
    print(f"\n| variant (KV {args.kv_cache_dtype}), ms a step | " + " | ".join(f"{b} seqs" for b in BATCHES) + " |")
    print("| --- |" + " ---: |" * len(BATCHES))
    for name, times in rows:
        print(f"| {name} | " + " | ".join(f"{ms:.3f}" for ms in times) + " |")


if __name__ == "__main__":
    main()
