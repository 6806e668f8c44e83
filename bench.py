"""Throughput on nano-vllm's workload: 256 sequences, prompt and output lengths uniform in 100..1024, seed 0.

    python bench.py                          # random weights: Qwen3-0.6B's shapes on CUDA, a tiny model on CPU
    python bench.py --model /path/to/model   # a real checkpoint
    python bench.py --enforce-eager          # without CUDA graphs
    python bench.py --engine hf              # Hugging Face generate on the same weights and prompts
    python bench.py --shape qwen3-30b-a3b    # random weights in another family's real shape (see --help)

A shape over 4 GB is not written: its weights are made in memory (load_format="dummy"; --engine hf: transformers'
random initialisation, which costs the same per token).
"""
import argparse
import time
from random import randint, seed

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from nanovllm import LLM, SamplingParams
from nanovllm.utils.random_checkpoint import SHAPES, checkpoint_bytes, default_checkpoint

DUMMY_ABOVE_BYTES = 4e9


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a Hugging Face model folder (default: random weights)")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="default: qwen3-0.6b on CUDA, tiny on CPU")
    parser.add_argument("--load-format", choices=["auto", "dummy"], help="dummy: random weights in memory "
                        "(default: dummy for a --shape whose checkpoint exceeds 4 GB)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--prefill-first", action="store_true", help="nano-vllm's steps instead of mixed ones")
    parser.add_argument("--no-async-scheduling", action="store_true", help="no overlap of host and device")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--engine", choices=["nanovllm", "hf"], default="nanovllm")
    parser.add_argument("--hf-output-len", type=int, default=512, help="fixed output length for --engine hf")
    parser.add_argument("--hf-batch-size", type=int, default=256)
    args = parser.parse_args(argv)
    for name in ("max_input_len", "max_output_len"):
        if args.min_len > vars(args)[name]:
            parser.error(f"--min-len {args.min_len} is over --{name.replace('_', '-')} {vars(args)[name]}")

    shape = args.shape or ("qwen3-0.6b" if torch.cuda.is_available() else "tiny")
    load_format = args.load_format or ("dummy" if not args.model and checkpoint_bytes(shape) > DUMMY_ABOVE_BYTES
                                       else "auto")
    path = args.model or str(default_checkpoint(shape, with_weights=load_format != "dummy"))
    vocab_size = AutoConfig.from_pretrained(path).vocab_size
    seed(0)  # the same draws as nano-vllm's bench.py, folded into small vocabularies
    prompt_token_ids = [[randint(0, 10000) % vocab_size for _ in range(randint(args.min_len, args.max_input_len))]
                        for _ in range(args.num_seqs)]
    output_lens = [randint(args.min_len, args.max_output_len) for _ in range(args.num_seqs)]

    model = args.model or f"random {shape}"
    if args.engine == "hf":
        print(f"Hugging Face generate on {model}: {len(prompt_token_ids)} prompts x {args.hf_output_len} new tokens",
              flush=True)
        total_tokens, elapsed, where = run_hf(path, prompt_token_ids, args.hf_output_len, args.hf_batch_size,
                                              random_init=load_format == "dummy")
    else:
        llm = LLM(path, enforce_eager=args.enforce_eager, max_model_len=args.max_model_len,
                  tensor_parallel_size=args.tp, prefill_first=args.prefill_first, load_format=load_format,
                  kv_cache_dtype=args.kv_cache_dtype, async_scheduling=not args.no_async_scheduling)
        runner = llm.model_runner
        where = (f"{llm.config.device}, {llm.config.dtype}, KV {llm.config.kv_cache_dtype}, TP={args.tp}"
                 + (", piecewise graphs" if runner.piecewise else "")
                 + (", fused rope+store" if runner.attn_layers[0].fuse_rope_store else ""))
        print(f"nano-vllm on {model} ({where}): {len(prompt_token_ids)} prompts, {sum(output_lens)} tokens to "
              "generate", flush=True)
        sampling_params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in output_lens]
        llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)  # warm-up
        ranks = llm.model_runner.call("describe")
        t = time.perf_counter()
        outputs = llm.generate(prompt_token_ids, sampling_params)  # a progress bar when stderr is a terminal
        elapsed = time.perf_counter() - t
        total_tokens = sum(len(o["token_ids"]) for o in outputs)
        if args.tp > 1:
            print_channel_cost(ranks, llm.model_runner.call("describe"))
    flags = "".join(f" ({f})" for f, on in (("eager", args.enforce_eager), ("prefill-first", args.prefill_first),
                                            ("no overlap", args.no_async_scheduling),
                                            ("dummy weights", load_format == "dummy")) if on)
    print(f"Engine: {args.engine}{flags} on {model} ({where}), Total: {total_tokens}tok, "
          f"Time: {elapsed:.2f}s, Throughput: {total_tokens / elapsed:.2f}tok/s")


def print_channel_cost(before: list[dict], after: list[dict]):
    """The TP channel's cost per call (about one per step) in the timed run."""
    for b, a in zip(before, after):
        calls = a["channel_calls"] - b["channel_calls"]
        per_call = (a["channel_seconds"] - b["channel_seconds"]) / max(calls, 1) * 1e6
        what = "to post a call" if a["rank"] == 0 else "from post to the call in hand"
        print(f"TP rank {a['rank']} ({a['device']}, {len(a['graphs'])} decode graphs): {calls} calls, "
              f"{per_call:.0f} us/call {what}")


def run_hf(path: str, prompt_token_ids: list[list[int]], output_len: int, batch_size: int,
           random_init: bool = False) -> tuple[int, float, str]:
    """Hugging Face generate (sdpa), greedy; returns the tokens, the seconds and where it ran."""
    cuda = torch.cuda.is_available()
    dtype, device = (torch.bfloat16, "cuda") if cuda else (torch.float32, "cpu")
    if random_init:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype,
                                                     attn_implementation="sdpa").eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    pad = model.config.pad_token_id or 0

    def batches():
        for i in range(0, len(prompt_token_ids), batch_size):
            chunk = prompt_token_ids[i:i + batch_size]
            width = max(map(len, chunk))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=model.device)  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=model.device)
            yield ids, mask

    model.generate(torch.tensor([[1, 2, 3]], device=model.device), max_new_tokens=4, do_sample=False)  # warm-up
    total, t = 0, time.perf_counter()
    with torch.inference_mode():
        for ids, mask in batches():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                                 do_sample=False, pad_token_id=pad)
            total += (out.size(1) - ids.size(1)) * ids.size(0)
    if cuda:
        torch.cuda.synchronize()
    return total, time.perf_counter() - t, f"{model.device.type}, {str(dtype).removeprefix('torch.')}"


if __name__ == "__main__":
    main()
