"""Cost of one sampling step for a batch of decodes (Qwen3-0.6B's vocabulary), on CUDA when present:
plain temperature rows (the fast path bench.py takes) vs rows that use every control.

    python benchmarks/sampler.py [--rows 256] [--vocab 151936] [--iters 20]
"""
import argparse
import random
import time

import numpy as np
import torch

from nanovllm import SamplingParams
from nanovllm.engine.penalty_slots import PenaltySlots
from nanovllm.engine.sampling_batch import build_sampling_batch
from nanovllm.engine.step_output import StepOutput
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import Sampler
from nanovllm.layers.triton_guard import triton_available
from nanovllm.layers.triton_sampler import make_rng_state


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rng = random.Random(0)

    def to_device(array: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(array))
        return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t

    def make_seqs(params: SamplingParams) -> list[Sequence]:
        seqs = []
        for _ in range(args.rows):
            seq = Sequence([rng.randrange(args.vocab) for _ in range(rng.randint(100, 1024))], params)
            for _ in range(rng.randint(1, 500)):
                seq.append_token(rng.randrange(args.vocab))
            seqs.append(seq)
        return seqs

    cases = {
        "plain (temperature 0.6)": SamplingParams(temperature=0.6),
        "top_p 0.9 + top_k 50": SamplingParams(temperature=0.6, top_p=0.9, top_k=50),
        "all controls": SamplingParams(temperature=0.6, top_p=0.9, top_k=50, min_p=0.05, seed=1, logprobs=5,
                                       repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1),
    }
    logits = torch.randn(args.rows, args.vocab, device=device, dtype=torch.bfloat16 if device.type == "cuda"
                         else torch.float32)
    # as the engine: the plain path is the Triton kernel on CUDA
    sampler = Sampler(make_rng_state(0, device) if device.type == "cuda" and triton_available() else None)
    generator = torch.Generator(device).manual_seed(0)
    penalty_slots = PenaltySlots(args.vocab, 4096, args.rows, device)
    print(f"{args.rows} rows x {args.vocab} vocab on {device}")
    print(f"{'case':<26} {'build ms':>9} {'sample ms':>10}")
    for name, params in cases.items():
        seqs = make_seqs(params)
        build = sample = 0.0
        for i in range(args.iters + 2):
            t0 = time.perf_counter()
            batch = build_sampling_batch(seqs, frozenset([2]), args.vocab, to_device, penalty_slots)
            t1 = time.perf_counter()
            sampled, logprobs = sampler.sample(logits, batch, generator)
            if batch.penalties is not None:  # as the model runner does
                penalty_slots.append(batch.penalties, sampled)
            StepOutput(sampled, logprobs, batch.num_logprobs).result()  # the one sync
            t2 = time.perf_counter()
            if i >= 2:  # the first two warm up
                build, sample = build + t1 - t0, sample + t2 - t1
        print(f"{name:<26} {1e3 * build / args.iters:>9.3f} {1e3 * sample / args.iters:>10.3f}")


if __name__ == "__main__":
    main()
