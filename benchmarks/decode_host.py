"""Decode steps on CUDA, small batches to large: ms per step against the floor, and how much of it is host work.
The same process runs it with the plain sampler inside the decode CUDA graph and, for comparison, with the
sampler launched after the graph (NANOVLLM_GRAPH_SAMPLER=0; every other part of the step is the same).

    python benchmarks/decode_host.py [--model PATH] [--batches 1 8 32 128 256] [--context 256] [--steps 100]

For each batch size, `batch` requests of `context` prompt tokens (temperature 0.6, as bench.py) are prefilled,
then `steps` decode steps of the engine's own loop (`llm.step()`, overlap scheduling on) are timed:
- ms/step: wall time per step;
- host ms: the host's busy time per step (wall time less the time spent waiting for a step's tokens);
- launch ms: the part of it in the model runner's `run` (inputs to the device, graph replay, sampler);
- floor ms: the weights and every sequence's KV read once at 4.27 TB/s (the H200's device-copy speed).
When the host is the bottleneck, host ms is close to ms/step. To compare with a version without this switch
(or without the one-copy inputs), run this script from a checkout of it: it uses nothing else.
"""
import argparse
import os
from time import perf_counter

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.step_output import StepOutput
from nanovllm.utils.random_checkpoint import default_checkpoint

COPY_BYTES_PER_S = 4.27e12


class Timer:
    """Adds up the time spent in a wrapped callable."""

    def __init__(self, fn):
        self.fn, self.total = fn, 0.0

    def __call__(self, *args, **kwargs):
        start = perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.total += perf_counter() - start


def measure(llm: LLM, batch: int, context: int, steps: int, waits: Timer) -> dict:
    params = SamplingParams(temperature=0.6, max_tokens=steps + 20, ignore_eos=True)
    vocab_size = llm.config.hf_config.vocab_size
    for i in range(batch):
        llm.add_request([(i * 7919 + j) % min(vocab_size, 10000) for j in range(context)], params)
    scheduler = llm.scheduler
    while scheduler.waiting or any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in scheduler.running):
        llm.step()  # prefill
    for _ in range(5):
        llm.step()
    runner = llm.model_runner
    launches = Timer(runner.run)
    runner.run = launches  # model_runner.call looks the method up on the instance
    torch.cuda.synchronize()
    waits.total = 0.0
    start = perf_counter()
    for _ in range(steps):
        llm.step()
    torch.cuda.synchronize()
    wall = perf_counter() - start
    del runner.run
    assert len(scheduler.running) == batch, "a request ended or was preempted while timed"
    while not llm.is_finished():
        llm.step()
    per_token_kv = runner.kv_cache[:, :, 0].numel() * runner.kv_cache.element_size() / llm.config.kvcache_block_size
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    floor = (weights + batch * (context + steps // 2) * per_token_kv) / COPY_BYTES_PER_S
    return {"ms/step": 1e3 * wall / steps, "host ms": 1e3 * (wall - waits.total) / steps,
            "launch ms": 1e3 * launches.total / steps, "floor ms": 1e3 * floor}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="a checkpoint folder (default: random Qwen3-0.6B weights made in memory)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark times CUDA decode steps"
    path = args.model or str(default_checkpoint("qwen3-0.6b", with_weights=False))
    engine_args = dict(max_num_seqs=max(args.batches), max_model_len=args.context + args.steps + 64,
                       load_format="auto" if args.model else "dummy")
    waits = Timer(StepOutput.result)
    StepOutput.result = lambda self: waits(self)  # the host blocks only here, waiting for a step's tokens
    rows = []
    for sample_in_graph in ("1", "0"):
        os.environ["NANOVLLM_GRAPH_SAMPLER"] = sample_in_graph
        with LLM(path, **engine_args) as llm:
            assert llm.model_runner.graphs is not None, "no CUDA graphs: nothing to compare"
            where = "in graph" if getattr(llm.model_runner.graphs, "samples", False) else "after graph"
            for batch in args.batches:
                rows.append((where, batch, measure(llm, batch, args.context, args.steps, waits)))
                print(f"  sampler {where}, batch {batch}: done", flush=True)
    print(f"\ndecode steps, context ~{args.context} + {args.steps} tokens, {torch.cuda.get_device_name()}")
    columns = list(rows[0][2])
    print(f"{'sampler':<12} {'batch':>5} " + " ".join(f"{c:>10}" for c in columns) + f" {'x floor':>8}")
    for where, batch, result in rows:
        print(f"{where:<12} {batch:>5} " + " ".join(f"{result[c]:>10.3f}" for c in columns)
              + f" {result['ms/step'] / result['floor ms']:>8.2f}")


if __name__ == "__main__":
    main()
