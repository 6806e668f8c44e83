import json
import os

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from nanovllm.utils import random_checkpoint as rc
from nanovllm.utils.random_checkpoint import SHAPES, default_checkpoint, make_random_checkpoint
from tests.conftest import in_background


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="module")
def tok(tiny):
    return AutoTokenizer.from_pretrained(tiny)


def _load(path):
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def _json(path, name="config.json"):
    return json.loads((path / name).read_text())


def _weights(path):
    return (path / "model.safetensors").read_bytes()


def _keys(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_slice(k).get_shape() for k in f.keys()}, f.metadata()


def test_files_and_config(tiny, tok):
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json"):
        assert (tiny / name).is_file(), name
    assert not [p for p in tiny.parent.iterdir() if p.name.startswith(".")], "temp dir left behind"
    cfg = _json(tiny)
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    for key, value in SHAPES["tiny"].items():  # transformers 5 stores rope_theta inside rope_parameters
        assert (cfg["rope_parameters"] if key == "rope_theta" else cfg)[key] == value, key
    assert cfg["eos_token_id"] == cfg["pad_token_id"] == cfg["bos_token_id"] == tok.eos_token_id
    gen = _json(tiny, "generation_config.json")
    assert gen["eos_token_id"] == [tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")]
    keys, meta = _keys(tiny)
    assert meta == {"format": "pt"}
    assert "lm_head.weight" not in keys and not any(k.endswith(".bias") for k in keys)


@torch.no_grad()
def test_hf_loads_and_runs(tiny):
    model = _load(tiny)
    assert model.dtype == torch.float32
    x = torch.randint(3, 512, (8, 64), generator=torch.Generator().manual_seed(1))
    logits = model(x).logits
    assert logits.shape == (8, 64, 512) and torch.isfinite(logits).all()
    top2 = logits.topk(2, dim=-1).values
    assert ((top2[..., 0] - top2[..., 1]) > 1e-3).float().mean() > 0.9  # no near-ties
    # the random model must actually use its context, not just echo the current token
    assert (logits.argmax(-1) == x).float().mean() < 0.2
    x2 = x.clone()
    x2[:, :32] = torch.randint(3, 512, (8, 32), generator=torch.Generator().manual_seed(2))
    logits2 = model(x2).logits
    assert (logits[:, 40:].argmax(-1) != logits2[:, 40:].argmax(-1)).float().mean() > 0.5


@torch.no_grad()
def test_overrides(tmp_path):
    ov = dict(num_key_value_heads=1, head_dim=32, attention_bias=True, tie_word_embeddings=False, num_hidden_layers=3)
    path = make_random_checkpoint(tmp_path / "ov", seed=3, **ov)
    cfg = _json(path)
    for key, value in ov.items():
        assert cfg[key] == value, key
    keys, _ = _keys(path)
    assert keys["lm_head.weight"] == [512, 64]
    for name, shape in dict(q_proj=[4 * 32, 64], k_proj=[32, 64], k_norm=[32]).items():
        assert keys[f"model.layers.2.self_attn.{name}.weight"] == shape, name
    for proj, n in dict(q_proj=128, k_proj=32, v_proj=32, o_proj=64).items():
        assert keys[f"model.layers.0.self_attn.{proj}.bias"] == [n]
    model = _load(path)
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert torch.isfinite(model(torch.tensor([[5, 6, 7]])).logits).all()


def test_bf16_dtype(tmp_path):
    path = make_random_checkpoint(tmp_path / "bf16", dtype="bfloat16")
    assert _json(path)["dtype"] == "bfloat16"
    assert AutoConfig.from_pretrained(path).dtype == torch.bfloat16
    assert _load(path).dtype == torch.bfloat16


def test_seed_determinism(tmp_path):
    a, b, c = (make_random_checkpoint(tmp_path / name, seed=seed) for name, seed in (("a", 0), ("b", 0), ("c", 1)))
    assert _weights(a) == _weights(b) != _weights(c)
    assert (a / "tokenizer.json").read_text() == (c / "tokenizer.json").read_text()


@pytest.mark.parametrize("text", [
    "Hello, world! The quick brown fox.", "héllo wörld 你好 🚀", "  tabs\tand\nnewlines\r\n ", ""])
def test_tokenizer_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert all(0 <= i < 512 for i in ids)
    assert tok.decode(ids) == text


def test_tokenizer_specials_and_size(tok, tmp_path):
    assert len(tok) <= 512
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert len(tok.encode("the")) < 3  # BPE merges were learned
    small = make_random_checkpoint(tmp_path / "small", vocab_size=259)  # the least
    assert len(AutoTokenizer.from_pretrained(small)) <= 259
    _load(small)
    with pytest.raises(ValueError):
        make_random_checkpoint(tmp_path / "too-small", vocab_size=100)


def test_chat_template(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 你好"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 你好<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs[1:], tokenize=False) == "<|im_start|>user\nHi 你好<|im_end|>\n"


def test_default_checkpoint_is_built_once_under_a_race_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path))
    runs = [in_background(default_checkpoint, "tiny") for _ in range(3)]
    for thread, _ in runs:
        thread.join()
    path = tmp_path / "random-tiny"  # no thread failed, all got the one folder
    assert [outcome for _, outcome in runs] == [{"value": path}] * 3 and rc.is_complete(path)
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert default_checkpoint() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert os.listdir(tmp_path) == ["random-tiny"]
    _load(path)


def test_lost_race_keeps_winner(tmp_path):
    (tmp_path / "m").mkdir()
    path = make_random_checkpoint(tmp_path / "m", seed=0)  # an existing empty folder is built into
    assert rc.is_complete(path) and os.listdir(tmp_path) == ["m"]
    before = _weights(path)
    rc._build(path, "tiny", 1, {}, replace=False)  # as if another process renamed first
    assert _weights(path) == before
    make_random_checkpoint(path, seed=1)  # explicit rebuild into an existing folder replaces it
    assert _weights(path) != before
    assert os.listdir(tmp_path) == ["m"]


def test_unknown_shape_and_field(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="tiny"):
        make_random_checkpoint(tmp_path / "x", shape="qwen3-99b")
    monkeypatch.setattr(rc, "is_complete", lambda *a: True)  # even if cached
    with pytest.raises(ValueError, match="qwen3-0.6b"):
        default_checkpoint("nope")
    for bad, match in [(dict(hidden_sise=32), r"\['hidden_sise'\]"), (dict(model_type="llama"), "model_type"),
                       (dict(num_key_value_heads=3), "multiple"), (dict(vocab_size=258), ">= 259")]:
        with pytest.raises(ValueError, match=match):
            make_random_checkpoint(tmp_path / "x", **bad)
    rc._resolve_config("tiny", dict(hidden_act="gelu"))  # not in the shape
    monkeypatch.delitem(SHAPES["tiny-qwen3-moe"], "num_experts")  # then an alias only (transformers 5)
    rc._resolve_config("tiny-qwen3-moe", dict(num_experts=4))
    assert not (tmp_path / "x").exists()


def test_a_tensor_of_more_than_one_chunk_is_drawn_whole():
    config = rc.hf_config(rc._resolve_config("tiny", dict(vocab_size=100_000)))  # 6.4M weights: 1.5 chunks
    name, embed = next(rc.random_tensors(config))
    assert name == "model.embed_tokens.weight"
    assert abs(embed.view(-1)[1 << 22:].std().item() - config.hidden_size ** -0.5) < 1e-3  # the last chunk's
