"""How much FP8 keys and values move a model's logits, whatever the kernels: Hugging Face on random Qwen3
checkpoints with K/V rounded inside attention, against the same model unrounded (CPU, float32).

    python benchmarks/fp8_kv_error.py [--tokens 300]

Prints, per storage of K/V, the share of positions whose argmax is unchanged and the logit error (median and max
over positions of the largest change); also the top-1 minus top-2 gap of the plain model, which says how many
near ties a checkpoint has. The numbers chose the FP8 scale (benchmarks/decode_attention_notes.md).
"""
import argparse
import random
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanovllm.utils.random_checkpoint import make_random_checkpoint  # noqa: E402

E4M3 = torch.float8_e4m3fn


def per_head_amax(x: torch.Tensor) -> torch.Tensor:  # x: [batch, heads, tokens, dim]
    scale = x.abs().amax(dim=(0, 2, 3), keepdim=True) / 448
    return (x / scale).to(E4M3).float() * scale


STORAGES = {
    "bf16": lambda k, v: (k.bfloat16().float(), v.bfloat16().float()),
    "fp8 e4m3, scale 1.0 per tensor": lambda k, v: (k.to(E4M3).float(), v.to(E4M3).float()),
    "fp8 e4m3, per-head amax / 448": lambda k, v: (per_head_amax(k), per_head_amax(v)),
    "fp8 e4m3, keys only": lambda k, v: (k.to(E4M3).float(), v),
    "fp8 e4m3, values only": lambda k, v: (k, v.to(E4M3).float()),
    "fp8 e5m2, scale 1.0": lambda k, v: (k.to(torch.float8_e5m2).float(), v.to(torch.float8_e5m2).float()),
}
current = {"storage": None}


def rounded_attention(module, query, key, value, attention_mask, **kwargs):
    if current["storage"] is not None:
        key, value = STORAGES[current["storage"]](key, value)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=300)
    args = parser.parse_args()
    AttentionInterface.register("kv_rounded", rounded_attention)
    folder = tempfile.mkdtemp()
    for name, shape, overrides in (("tiny", "tiny", {}),
                                   ("0.6B widths, 4 layers", "qwen3-0.6b", dict(num_hidden_layers=4, dtype="float32"))):
        path = make_random_checkpoint(f"{folder}/{shape}", shape, **overrides)
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                     attn_implementation="kv_rounded").eval()
        rng = random.Random(0)
        ids = torch.tensor([[rng.randrange(3, 500) for _ in range(args.tokens)]])
        current["storage"] = None
        with torch.no_grad():
            plain = model(ids).logits[0].float()
        top2 = plain.topk(2, -1).values
        gap = top2[:, 0] - top2[:, 1]
        print(f"{name}: top-1 minus top-2 logit, quantiles 3/10/50%: "
              f"{', '.join(f'{gap.quantile(q).item():.3f}' for q in (0.03, 0.1, 0.5))}")
        for storage in STORAGES:
            current["storage"] = storage
            with torch.no_grad():
                logits = model(ids).logits[0].float()
            error = (logits - plain).abs().max(-1).values
            agree = (logits.argmax(-1) == plain.argmax(-1)).float().mean().item()
            print(f"  {storage:32s} argmax unchanged {agree:.1%}, logit error median {error.median():.3f} "
                  f"max {error.max():.3f}")


if __name__ == "__main__":
    main()
