"""Throughput on nano-vllm's workload: 256 sequences, prompt and output lengths uniform in 100..1024, seed 0.

    python bench.py                          # random weights: Qwen3-0.6B's shapes on CUDA, a tiny model on CPU
    python bench.py --model /path/to/model   # a real checkpoint
    python bench.py --enforce-eager          # without CUDA graphs
"""
import argparse
import time
from random import randint, seed

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.utils.random_checkpoint import default_checkpoint


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a Hugging Face model folder (default: random weights)")
    parser.add_argument("--shape", help="random-weight shape when no --model is given "
                        "(default: qwen3-0.6b on CUDA, tiny on CPU)")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    args = parser.parse_args()

    path = args.model or str(default_checkpoint(args.shape or ("qwen3-0.6b" if torch.cuda.is_available() else "tiny")))
    llm = LLM(path, enforce_eager=args.enforce_eager, max_model_len=args.max_model_len,
              tensor_parallel_size=args.tp)
    vocab = min(10000, llm.config.hf_config.vocab_size)

    seed(0)
    prompt_token_ids = [[randint(0, vocab - 1) for _ in range(randint(args.min_len, args.max_input_len))]
                        for _ in range(args.num_seqs)]
    sampling_params = [SamplingParams(temperature=0.6, ignore_eos=True,
                                      max_tokens=randint(args.min_len, args.max_output_len))
                       for _ in range(args.num_seqs)]

    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outputs = llm.generate(prompt_token_ids, sampling_params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    total_tokens = sum(len(o["token_ids"]) for o in outputs)
    print(f"Total: {total_tokens}tok, Time: {elapsed:.2f}s, Throughput: {total_tokens / elapsed:.2f}tok/s")


if __name__ == "__main__":
    main()
