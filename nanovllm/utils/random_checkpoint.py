"""Random-weight Qwen3 checkpoints with a locally trained byte-level BPE tokenizer.

Lets tests, example.py and bench.py run with nothing downloaded:

    path = make_random_checkpoint("/tmp/qwen3-tiny")          # or
    path = default_checkpoint("tiny")                           # cached build
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch

SHAPES: dict[str, dict] = {
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=4096,
        rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False,
        dtype="float32",
    ),
    "qwen3-0.6b": dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False,
        dtype="bfloat16",
    ),
}

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END]
MAX_TOKENIZER_VOCAB = 512

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Random-weight scales. With the customary std 0.02 everywhere, a small random Qwen3 is a pure
# "repeat the input token" model: the tied embedding dominates the residual stream, the argmax is
# the current token ~100% of the time and the context is ignored, so an engine test comparing
# outputs would pass even with broken attention / KV cache. Instead linear weights get std
# LINEAR_GAIN / sqrt(fan_in) (about 0.02-0.06 at 0.6B scale), so every layer moves the residual
# stream and greedy outputs depend on the whole context; the embedding / LM head gets
# std 1 / sqrt(hidden_size), giving logits of std ~1 with well separated top-1 / top-2 values.
# QK-norm keeps attention scores O(1) whatever the scale, norms are 1 + noise so they matter.
LINEAR_GAIN, BIAS_STD, NORM_STD = 2.0, 0.02, 0.1

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small language model reads a prompt,
splits it into tokens, and predicts the next token one step at a time. Each step looks
at every token that came before it, so the engine keeps keys and values in a cache.
Once upon a time there was a little engine that could serve many requests at once.
It packed the prompts together, scheduled the decoding steps, and returned the answers
in the order they were asked. When memory ran short, it paused a request and resumed
it later. Numbers such as 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42, 100 and 2024 appear
in text too, as do questions? Exclamations! Quotes "like this", (parentheses),
lists: apples; bananas; cherries - and code like def main(): return x + y * 2.
Hello, world. How are you today? I am fine, thank you. Please tell me a story about
the sea, the mountains, the river and the forest. What is the capital of France?
The capital of France is Paris. Write a short poem about the moon and the stars.
"""
_WORDS = (
    "the of and to in is that it for was on are as with his they at be this from have or by "
    "one had not but what all were when we there can an your which their said if do will each "
    "about how up out them then she many some so these would other into has more her two like "
    "him see time could no make than first been its who now people my made over did down only "
    "way find use may water long little very after words called just where most know get "
    "through back much before go good new write our used me man too any day same right look "
    "think also around another came come work three word must because does part even place well"
).split()


def _corpus() -> list[str]:
    lines = _CORPUS.splitlines()
    # deterministic pseudo-sentences from the word list, so common words become merges
    n = len(_WORDS)
    for i in range(200):
        words = [_WORDS[(i * 7 + k * 13 + k * k * i) % n] for k in range(6 + i % 7)]
        lines.append(" ".join(words).capitalize() + ".")
    return lines


def _resolve_config(shape: str, overrides: dict) -> dict:
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; valid shapes: {sorted(SHAPES)}")
    from transformers import Qwen3Config

    known = set(SHAPES[shape]) | set(Qwen3Config().to_dict())
    bad = sorted(set(overrides) - known)
    if bad:
        raise ValueError(f"unknown Qwen3 config field(s): {bad}")
    cfg = {**SHAPES[shape], **overrides}
    if cfg["num_attention_heads"] % cfg["num_key_value_heads"]:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    if cfg["vocab_size"] < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} for a byte-level BPE")
    return cfg


def build_tokenizer(vocab_size: int, model_max_length: int = 4096):
    """Train a byte-level BPE (<= min(vocab_size, 512) tokens incl. specials) and wrap it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, MAX_TOKENIZER_VOCAB),
        special_tokens=SPECIAL_TOKENS,  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )
    fast.chat_template = CHAT_TEMPLATE
    assert len(fast) <= vocab_size, (len(fast), vocab_size)
    return fast


def _param_specs(cfg: dict):
    """(name, shape, mean, std) with the names and shapes of transformers' Qwen3ForCausalLM."""
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    embed = (cfg["vocab_size"], h), 0.0, h ** -0.5

    linear = lambda out_f, in_f: ((out_f, in_f), 0.0, LINEAR_GAIN * in_f ** -0.5)  # noqa: E731
    norm = lambda n: ((n,), 1.0, NORM_STD)  # noqa: E731

    yield ("model.embed_tokens.weight", *embed)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for proj, (out_f, in_f) in dict(q_proj=(q, h), k_proj=(kv, h), v_proj=(kv, h), o_proj=(h, q)).items():
            yield (f"{p}self_attn.{proj}.weight", *linear(out_f, in_f))
            if cfg["attention_bias"]:
                yield f"{p}self_attn.{proj}.bias", (out_f,), 0.0, BIAS_STD
        yield (f"{p}self_attn.q_norm.weight", *norm(d))
        yield (f"{p}self_attn.k_norm.weight", *norm(d))
        yield (f"{p}mlp.gate_proj.weight", *linear(inter, h))
        yield (f"{p}mlp.up_proj.weight", *linear(inter, h))
        yield (f"{p}mlp.down_proj.weight", *linear(h, inter))
        yield (f"{p}input_layernorm.weight", *norm(h))
        yield (f"{p}post_attention_layernorm.weight", *norm(h))
    yield ("model.norm.weight", *norm(h))
    if not cfg["tie_word_embeddings"]:
        yield ("lm_head.weight", *embed)


def random_state_dict(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights, generated in float32 chunks (bounded memory) and stored in cfg's dtype."""
    dtype = getattr(torch, cfg.get("dtype") or "float32")
    gen = torch.Generator().manual_seed(seed)
    buf = torch.empty(1 << 22, dtype=torch.float32)
    out = {}
    for name, shape, mean, std in _param_specs(cfg):
        t = torch.empty(shape, dtype=dtype)
        flat = t.view(-1)
        for start in range(0, flat.numel(), buf.numel()):
            chunk = flat[start:start + buf.numel()]
            chunk.copy_(buf[:chunk.numel()].normal_(mean, std, generator=gen))
        out[name] = t
    return out


def _write(folder: Path, cfg: dict, seed: int) -> None:
    from safetensors.torch import save_file
    from transformers import GenerationConfig, Qwen3Config

    tokenizer = build_tokenizer(cfg["vocab_size"], cfg["max_position_embeddings"])
    eos, im_end = tokenizer.convert_tokens_to_ids([EOS_TOKEN, IM_END])
    tokenizer.save_pretrained(folder)
    config = Qwen3Config(
        **cfg, architectures=["Qwen3ForCausalLM"], bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
    )
    config.save_pretrained(folder)
    GenerationConfig(bos_token_id=eos, eos_token_id=[eos, im_end], pad_token_id=eos).save_pretrained(folder)
    save_file(random_state_dict(cfg, seed), str(folder / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(folder / "model.safetensors", 0o644)  # safetensors creates it 0600


_REQUIRED = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def is_complete(path: str | os.PathLike) -> bool:
    path = Path(path)
    return all((path / f).is_file() for f in _REQUIRED)


def _build(path: Path, shape: str, seed: int, overrides: dict, replace: bool) -> Path:
    cfg = _resolve_config(shape, overrides)
    path = Path(path).expanduser().absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write(tmp, cfg, seed)
        try:
            os.rename(tmp, path)  # atomic; also replaces an empty directory
        except OSError:
            if replace:  # a non-empty folder already exists: move files in, config.json last
                names = sorted(os.listdir(tmp), key=lambda n: n == "config.json")
                for name in names:
                    os.replace(tmp / name, path / name)
            # else: another process won the race; its checkpoint is used
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def make_random_checkpoint(path, shape: str = "tiny", seed: int = 0, **overrides) -> Path:
    """Write a random-weight Qwen3ForCausalLM checkpoint plus tokenizer into folder `path`."""
    return _build(Path(path), shape, seed, overrides, replace=True)


def default_checkpoint(shape: str = "tiny") -> Path:
    """Cached random checkpoint under $NANOVLLM_CACHE (or ~/.cache/nanovllm), built on first use."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; valid shapes: {sorted(SHAPES)}")
    root = Path(os.environ.get("NANOVLLM_CACHE") or Path.home() / ".cache" / "nanovllm").expanduser()
    path = root / f"random-{shape}"
    if not is_complete(path):
        # replace only a pre-existing incomplete folder; if we lose a rename race, use the winner's
        _build(path, shape, 0, {}, replace=path.exists())
    return path


def _main() -> None:  # python -m nanovllm.utils.random_checkpoint PATH [--shape S] [--seed N] [--set K=JSON ...]
    import argparse, time

    ap = argparse.ArgumentParser(description="write a random-weight Qwen3 checkpoint")
    ap.add_argument("path")
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=JSON", help="config overrides")
    args, t = ap.parse_args(), time.perf_counter()
    out = make_random_checkpoint(args.path, args.shape, args.seed, **{k: json.loads(v) for k, v in (a.split("=", 1) for a in args.set)})
    print(f"wrote {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e9:.3f} GB) in {time.perf_counter() - t:.1f}s")


if __name__ == "__main__":
    _main()
