"""Small decode steps with other tuned choices, each variant an engine in a process of its own (the choices are
read when the CUDA graphs are captured, so one engine cannot time two): ms per step by batch, a row a variant.

    python benchmarks/step_variants.py --batch 1 4 16 32 --variant "" --variant "down=32,512,4" --variant ""

A variant is NAME=VALUE pairs, space-separated: `split` (the decode kernel's minimum split where the merge takes
a tile, MIN_SPLIT_TOKENS_TILE_MERGE), `min_split` (MIN_SPLIT_TOKENS), `target` (the programs an SM that a split
batch aims at, SPLIT_TARGET_PROGRAMS_PER_SM), `splits` (the split count of every batch that splits), `prefetch`
(KV_PREFETCH_TILES), and the skinny projections' tiles `qkv`, `o_proj`, `gate_up`, `down` as
block_n,block_k,num_warps (qkv's block_n is half a head), at every row count or, as `gate_up@32=...`, only where
the rows pad to that block (16: 1-16 rows, 32: 17-32). "" is the code as it is: time it first and last to see the
run-to-run noise. Steps are timed as `profile_decode.py` times them (`--context`: ~1,000 tokens, or several
lengths; `--kv-cache-dtype`), on an engine of at most the largest batch's sequences (fewer graphs to capture than
the default 512).
Session 29 chose the down projection's tiles at up to 16 rows so (benchmarks/HISTORY.md).
"""
import argparse
import subprocess
import sys
import time

SETTINGS = {"split": "MIN_SPLIT_TOKENS_TILE_MERGE", "min_split": "MIN_SPLIT_TOKENS",
            "target": "SPLIT_TARGET_PROGRAMS_PER_SM", "prefetch": "KV_PREFETCH_TILES",
            "splits": None}  # their names in triton_attention (`splits` replaces decode_splits' count where it splits)
TILES = ("qkv", "o_proj", "gate_up", "down")


def parse_variant(text: str) -> dict:
    """"split=64 down=32,512,4 qkv@32=64,128,8" -> {"split": 64, "down": (32, 512, 4), "qkv@32": (64, 128, 8)};
    a ValueError names what is wrong."""
    variant = {}
    for item in text.split():
        key, _, value = item.partition("=")
        name, _, rows = key.partition("@")
        if rows not in ("", "16", "32") or (rows and name not in TILES):
            raise ValueError(f"{key!r} in {text!r}: only a tile takes @16 or @32")
        if name not in (*SETTINGS, *TILES):
            raise ValueError(f"unknown setting {name!r} in {text!r}: one of {', '.join((*SETTINGS, *TILES))}")
        numbers = tuple(int(v) for v in value.split(",")) if value else ()
        if len(numbers) != (1 if name in SETTINGS else 3):
            raise ValueError(f"{item!r}: {name} takes {'a number' if name in SETTINGS else 'block_n,block_k,warps'}")
        variant[key] = numbers[0] if name in SETTINGS else numbers
    return variant


def projection(k: int, gated: bool, head_dim: int, intermediate_size: int) -> str:
    """Which of a dense layer's projections a `triton_skinny.plan` call is for."""
    if head_dim:
        return "qkv"
    if gated:
        return "gate_up"
    return "down" if k == intermediate_size else "o_proj"


def apply(variant: dict, intermediate_size: int):
    """Set the variant's choices in the modules that read them."""
    from nanovllm.layers import triton_attention, triton_skinny
    for name, attribute in SETTINGS.items():
        if name in variant and attribute:  # (a setting by the cache's bytes an element takes the value for each)
            current = getattr(triton_attention, attribute)
            setattr(triton_attention, attribute, dict.fromkeys(current, variant[name]) if isinstance(current, dict)
                    else variant[name])
    if "splits" in variant:
        heuristic = triton_attention.decode_splits
        triton_attention.decode_splits = lambda *shape: variant["splits"] if heuristic(*shape) > 1 else 1
    tuned = triton_skinny.plan

    def plan(block_m, k, gated, head_dim=0):
        name = projection(k, gated, head_dim, intermediate_size)
        return variant.get(f"{name}@{block_m}") or variant.get(name) or tuned(block_m, k, gated, head_dim)
    triton_skinny.plan = plan


def one(args):
    """The child: one variant's engine, a RESULT line of ms per step."""
    from transformers import AutoConfig
    from nanovllm import LLM
    from nanovllm.utils.random_checkpoint import default_checkpoint
    from profile_decode import profile_batch
    model = args.model or str(default_checkpoint("qwen3-0.6b"))
    apply(parse_variant(args.one), AutoConfig.from_pretrained(model).intermediate_size)
    llm = LLM(model, max_num_seqs=max(args.batch), kv_cache_dtype=args.kv_cache_dtype)
    timings = [argparse.Namespace(context=c, steps=args.steps, rows=0, trace=None) for c in args.context]
    print("RESULT", *(f"{profile_batch(llm, b, t) * 1e3:.3f}" for t in timings for b in args.batch), flush=True)
    llm.exit()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--context", type=int, nargs="+", default=[1000])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--variant", action="append", help='e.g. "split=64 down=32,512,4"; "" is the code as it is')
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        return one(args)
    variants = args.variant or [""]
    for text in variants:  # every variant's error before the first engine starts
        try:
            parse_variant(text)
        except ValueError as e:
            parser.error(str(e))
    rows = []
    for text in variants:
        start = time.perf_counter()
        command = [sys.executable, __file__, "--one", text, "--batch", *map(str, args.batch), "--context",
                   *map(str, args.context), "--steps", str(args.steps), "--kv-cache-dtype", args.kv_cache_dtype]
        command += ["--model", args.model] if args.model else []
        child = subprocess.run(command, capture_output=True, text=True)
        result = [line.split()[1:] for line in child.stdout.splitlines() if line.startswith("RESULT")]
        if child.returncode or not result:
            sys.exit(f"variant {text!r} failed ({child.returncode}):\n{child.stderr[-3000:]}")
        rows.append((text or "(as it is)", result[0]))
        print(f"{rows[-1][0]}: {' '.join(result[0])} ms/step ({time.perf_counter() - start:.0f} s)", flush=True)
    columns = [f"batch {b}" + (f" x {c}" if len(args.context) > 1 else "") for c in args.context for b in args.batch]
    print(f"| variant | {' | '.join(columns)} |")
    print(f"| --- |{' ---: |' * len(columns)}")
    for text, times in rows:
        print(f"| {text} | {' | '.join(times)} |")


if __name__ == "__main__":
    main()
