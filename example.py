"""Generate text for a few chat prompts.

    python example.py                      # ~/huggingface/Qwen3-0.6B if present, else a tiny random model
    python example.py --model /path/to/hf-model-folder
"""
import argparse
import os

from nanovllm import LLM, SamplingParams
from nanovllm.utils.random_checkpoint import default_checkpoint

DEFAULT_MODEL = os.path.expanduser("~/huggingface/Qwen3-0.6B/")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a Hugging Face model folder (default: %(default)s)", default=None)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    args = parser.parse_args()

    path = args.model or (DEFAULT_MODEL if os.path.isdir(DEFAULT_MODEL) else None)
    if path is None:
        path = str(default_checkpoint("tiny"))
        print(f"No model given and {DEFAULT_MODEL} not found: using a tiny model with RANDOM weights at {path}.\n"
              "Its output is gibberish; pass --model PATH for a real one.\n")
    llm = LLM(path, enforce_eager=args.enforce_eager, tensor_parallel_size=args.tp)
    tokenizer = llm.tokenizer
    sampling_params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    prompts = ["introduce yourself", "list all prime numbers within 100"]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                      add_generation_prompt=True, enable_thinking=True)
        for prompt in prompts
    ]
    outputs = llm.generate(prompts, sampling_params)
    for prompt, output in zip(prompts, outputs):
        print("\n")
        print(f"Prompt: {prompt!r}")
        print(f"Completion: {output['text']!r}")


if __name__ == "__main__":
    main()
