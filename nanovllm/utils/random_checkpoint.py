"""Random-weight checkpoints of every supported family, with a locally trained byte-level BPE tokenizer.

Lets tests, example.py and bench.py run with nothing downloaded:

    path = make_random_checkpoint("/tmp/qwen3-tiny")            # or
    path = default_checkpoint("tiny")                             # cached build
    path = make_random_checkpoint("/tmp/moe", "qwen3-30b-a3b", with_weights=False)   # for load_format="dummy"

A shape (`utils/shapes.py`) is a config of one family; the real ones carry the published configs' numbers. The
tensors' names and shapes follow the family's options in `nanovllm/models` (the same ones the engine builds
from), and `random_tensors` streams them, which is also what load_format="dummy" loads.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch

from nanovllm.utils.shapes import ARCHITECTURES, SHAPES

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

# Random-weight scales. With std 0.02 everywhere, a small random Qwen3 repeats its input token, whatever the
# context (the tied embedding dominates the residual stream), so a test comparing outputs would pass with broken
# attention or KV cache. Instead linear weights get std LINEAR_GAIN / sqrt(fan_in) (about 0.02-0.06 at 0.6B), so
# every layer moves the residual stream and greedy outputs depend on the whole context; the embedding / LM head
# gets std 1 / sqrt(hidden_size): logits of std ~1, top-1 / top-2 well apart. QK-norm keeps attention scores O(1)
# whatever the scale; norms are 1 + noise so they matter.
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
    from transformers import CONFIG_MAPPING

    cfg = {"model_type": "qwen3", **SHAPES[shape]}
    config_class = CONFIG_MAPPING[cfg["model_type"]]
    if "model_type" in overrides:
        raise ValueError(f"model_type cannot be overridden; pick a shape of that family from {sorted(SHAPES)}")
    known = set(cfg) | set(config_class().to_dict()) | set(config_class.attribute_map)
    bad = sorted(set(overrides) - known)
    if bad:
        raise ValueError(f"unknown {config_class.__name__} config field(s): {bad}")
    cfg.update(overrides)
    if cfg["num_attention_heads"] % cfg["num_key_value_heads"]:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    if cfg["vocab_size"] < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} for a byte-level BPE")
    return cfg


def hf_config(cfg: dict, **token_ids):
    """The transformers config of a resolved shape."""
    from transformers import CONFIG_MAPPING

    fields = {key: value for key, value in cfg.items() if key != "model_type"}
    return CONFIG_MAPPING[cfg["model_type"]](**fields, architectures=[ARCHITECTURES[cfg["model_type"]]], **token_ids)


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


def param_specs(config):
    """(name, shape, mean, std) of every tensor of a checkpoint of `config`, in transformers' names; which
    tensors exist (biases, q/k norms, experts) is what the family in `nanovllm.models` builds."""
    from nanovllm.models import model_class
    from nanovllm.models.decoder import head_dim

    family = model_class(config)
    attention = family.attention_options(config)
    h, d = config.hidden_size, head_dim(config)
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    embed = (config.vocab_size, h), 0.0, h ** -0.5

    linear = lambda out_f, in_f: ((out_f, in_f), 0.0, LINEAR_GAIN * in_f ** -0.5)  # noqa: E731
    norm = lambda n: ((n,), 1.0, NORM_STD)  # noqa: E731

    def gated_mlp(prefix: str, size: int, bias: bool):
        for proj, (out_f, in_f) in dict(gate_proj=(size, h), up_proj=(size, h), down_proj=(h, size)).items():
            yield (f"{prefix}{proj}.weight", *linear(out_f, in_f))
            if bias:
                yield f"{prefix}{proj}.bias", (out_f,), 0.0, BIAS_STD

    yield ("model.embed_tokens.weight", *embed)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        for proj, (out_f, in_f) in dict(q_proj=(q, h), k_proj=(kv, h), v_proj=(kv, h), o_proj=(h, q)).items():
            yield (f"{p}self_attn.{proj}.weight", *linear(out_f, in_f))
            if attention.o_bias if proj == "o_proj" else attention.qkv_bias:
                yield f"{p}self_attn.{proj}.bias", (out_f,), 0.0, BIAS_STD
        if attention.qk_norm:
            yield (f"{p}self_attn.q_norm.weight", *norm(d))
            yield (f"{p}self_attn.k_norm.weight", *norm(d))
        mlp = family.mlp_options(config, i)
        if mlp.num_experts:
            # router logits of std ~LINEAR_GAIN: tokens spread over the experts, and routing depends on context
            yield (f"{p}mlp.gate.weight", *linear(mlp.num_experts, h))
            for e in range(mlp.num_experts):
                yield from gated_mlp(f"{p}mlp.experts.{e}.", mlp.intermediate_size, False)
        else:
            yield from gated_mlp(f"{p}mlp.", mlp.intermediate_size, mlp.bias)
        yield (f"{p}input_layernorm.weight", *norm(h))
        yield (f"{p}post_attention_layernorm.weight", *norm(h))
    yield ("model.norm.weight", *norm(h))
    if not config.tie_word_embeddings:
        yield ("lm_head.weight", *embed)


def checkpoint_dtype(config) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or torch.float32
    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype).removeprefix("torch."))


def random_tensors(config, seed: int = 0, device: str | torch.device = "cpu"):
    """(name, tensor) of `param_specs(config)`, one at a time, in the config's dtype on `device`; drawn in
    float32 chunks from one generator (bounded memory; on CPU the same numbers whatever the device count)."""
    dtype = checkpoint_dtype(config)
    gen = torch.Generator(device).manual_seed(seed)
    buf = torch.empty(1 << 22, dtype=torch.float32, device=device)
    for name, shape, mean, std in param_specs(config):
        t = torch.empty(shape, dtype=dtype, device=device)
        flat = t.view(-1)
        for start in range(0, flat.numel(), buf.numel()):
            chunk = flat[start:start + buf.numel()]
            chunk.copy_(buf[:chunk.numel()].normal_(mean, std, generator=gen))
        yield name, t


def checkpoint_bytes(shape: str, **overrides) -> int:
    """Bytes of the weights of a random checkpoint of `shape` (nothing is generated)."""
    config = hf_config(_resolve_config(shape, overrides))
    itemsize = checkpoint_dtype(config).itemsize
    return sum(itemsize * torch.Size(shape).numel() for _, shape, _, _ in param_specs(config))


def _write(folder: Path, cfg: dict, seed: int, with_weights: bool) -> None:
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    tokenizer = build_tokenizer(cfg["vocab_size"], cfg["max_position_embeddings"])
    eos, im_end = tokenizer.convert_tokens_to_ids([EOS_TOKEN, IM_END])
    tokenizer.save_pretrained(folder)
    config = hf_config(cfg, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    config.save_pretrained(folder)
    GenerationConfig(bos_token_id=eos, eos_token_id=[eos, im_end], pad_token_id=eos).save_pretrained(folder)
    if with_weights:
        save_file(dict(random_tensors(config, seed)), str(folder / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(folder / "model.safetensors", 0o644)  # safetensors creates it 0600


_REQUIRED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def is_complete(path: str | os.PathLike, with_weights: bool = True) -> bool:
    path = Path(path)
    return all((path / f).is_file() for f in _REQUIRED + ("model.safetensors",) * with_weights)


def _build(path: Path, shape: str, seed: int, overrides: dict, replace: bool, with_weights: bool = True) -> Path:
    cfg = _resolve_config(shape, overrides)
    path = Path(path).expanduser().absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write(tmp, cfg, seed, with_weights)
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


def make_random_checkpoint(path, shape: str = "tiny", seed: int = 0, with_weights: bool = True,
                           **overrides) -> Path:
    """Write a random-weight checkpoint of `shape`'s family plus tokenizer into folder `path`; without weights,
    only the config and tokenizer (for load_format="dummy", which makes the same weights in memory)."""
    return _build(Path(path), shape, seed, overrides, replace=True, with_weights=with_weights)


def default_checkpoint(shape: str = "tiny", with_weights: bool = True) -> Path:
    """Cached random checkpoint under $NANOVLLM_CACHE (or ~/.cache/nanovllm), built on first use."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; valid shapes: {sorted(SHAPES)}")
    root = Path(os.environ.get("NANOVLLM_CACHE") or Path.home() / ".cache" / "nanovllm").expanduser()
    path = root / (f"random-{shape}" if with_weights else f"random-{shape}-no-weights")
    if not is_complete(path, with_weights):
        # replace only a pre-existing incomplete folder; if we lose a rename race, use the winner's
        _build(path, shape, 0, {}, replace=path.exists(), with_weights=with_weights)
    return path


def _main() -> None:  # python -m nanovllm.utils.random_checkpoint PATH [--shape S] [--seed N] [--set K=JSON ...]
    import argparse, time

    ap = argparse.ArgumentParser(description="write a random-weight checkpoint")
    ap.add_argument("path")
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-weights", action="store_true", help="config and tokenizer only (load_format='dummy')")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=JSON", help="config overrides")
    args, t = ap.parse_args(), time.perf_counter()
    overrides = {k: json.loads(v) for k, v in (a.split("=", 1) for a in args.set)}
    out = make_random_checkpoint(args.path, args.shape, args.seed, not args.no_weights, **overrides)
    print(f"wrote {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e9:.3f} GB) in {time.perf_counter() - t:.1f}s")


if __name__ == "__main__":
    _main()
