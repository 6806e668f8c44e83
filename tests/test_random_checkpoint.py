import json
import threading

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from nanovllm.utils import random_checkpoint as rc
from nanovllm.utils.random_checkpoint import SHAPES, default_checkpoint, make_random_checkpoint


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


def _load(path):
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def _keys(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_slice(k).get_shape() for k in f.keys()}, f.metadata()


def test_files_and_config(tiny):
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tiny / name).is_file(), name
    assert not [p for p in tiny.parent.iterdir() if p.name.startswith(".")], "temp dir left behind"
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    for key, value in SHAPES["tiny"].items():
        if key == "rope_theta":  # transformers 5 stores it inside rope_parameters
            assert cfg["rope_parameters"]["rope_theta"] == value
        else:
            assert cfg[key] == value, key
    tok = AutoTokenizer.from_pretrained(tiny)
    assert cfg["eos_token_id"] == cfg["pad_token_id"] == cfg["bos_token_id"] == tok.eos_token_id
    gen = json.loads((tiny / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")]
    keys, meta = _keys(tiny)
    assert meta == {"format": "pt"}
    assert "lm_head.weight" not in keys and not any(k.endswith(".bias") for k in keys)


def test_hf_loads_and_runs(tiny):
    model = _load(tiny)
    assert model.dtype == torch.float32
    x = torch.randint(3, 512, (8, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(x).logits
    assert logits.shape == (8, 64, 512) and torch.isfinite(logits).all()
    top2 = logits.topk(2, dim=-1).values
    assert ((top2[..., 0] - top2[..., 1]) > 1e-3).float().mean() > 0.9  # no near-ties
    # the random model must actually use its context, not just echo the current token
    assert (logits.argmax(-1) == x).float().mean() < 0.2
    x2 = x.clone()
    x2[:, :32] = torch.randint(3, 512, (8, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits2 = model(x2).logits
    assert (logits[:, 40:].argmax(-1) != logits2[:, 40:].argmax(-1)).float().mean() > 0.5


def test_overrides(tmp_path):
    ov = dict(num_key_value_heads=1, head_dim=32, attention_bias=True, tie_word_embeddings=False, num_hidden_layers=3)
    path = make_random_checkpoint(tmp_path / "ov", seed=3, **ov)
    cfg = json.loads((path / "config.json").read_text())
    for key, value in ov.items():
        assert cfg[key] == value, key
    keys, _ = _keys(path)
    assert keys["lm_head.weight"] == [512, 64]
    assert keys["model.layers.2.self_attn.q_proj.weight"] == [4 * 32, 64]
    assert keys["model.layers.2.self_attn.k_proj.weight"] == [32, 64]
    assert keys["model.layers.2.self_attn.k_norm.weight"] == [32]
    for proj, n in dict(q_proj=128, k_proj=32, v_proj=32, o_proj=64).items():
        assert keys[f"model.layers.0.self_attn.{proj}.bias"] == [n]
    model = _load(path)
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[5, 6, 7]])).logits).all()


def test_bf16_dtype(tmp_path):
    path = make_random_checkpoint(tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoConfig.from_pretrained(path).dtype == torch.bfloat16
    assert _load(path).dtype == torch.bfloat16


def test_seed_determinism(tmp_path):
    a = make_random_checkpoint(tmp_path / "a", seed=0)
    b = make_random_checkpoint(tmp_path / "b", seed=0)
    c = make_random_checkpoint(tmp_path / "c", seed=1)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_text() == (c / "tokenizer.json").read_text()


@pytest.mark.parametrize("text", ["Hello, world! The quick brown fox.", "héllo wörld 你好 🚀", "  tabs\tand\nnewlines\r\n ", ""])
def test_tokenizer_round_trip(tiny, text):
    tok = AutoTokenizer.from_pretrained(tiny)
    ids = tok.encode(text, add_special_tokens=False)
    assert all(0 <= i < 512 for i in ids)
    assert tok.decode(ids) == text


def test_tokenizer_specials_and_size(tiny, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny)
    assert len(tok) <= 512
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert len(tok.encode("the")) < 3  # BPE merges were learned
    small = make_random_checkpoint(tmp_path / "small", vocab_size=300)
    assert len(AutoTokenizer.from_pretrained(small)) <= 300
    _load(small)
    with pytest.raises(ValueError):
        make_random_checkpoint(tmp_path / "too-small", vocab_size=100)


def test_chat_template(tiny):
    tok = AutoTokenizer.from_pretrained(tiny)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 你好"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 你好<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs[1:], tokenize=False) == "<|im_start|>user\nHi 你好<|im_end|>\n"


def test_default_checkpoint_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path))
    path = default_checkpoint()
    assert path == tmp_path / "random-tiny" and rc.is_complete(path)
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert default_checkpoint("tiny") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert sorted(p.name for p in tmp_path.iterdir()) == ["random-tiny"]


def test_default_checkpoint_race(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path))
    results, errors = [], []

    def worker():
        try:
            results.append(default_checkpoint("tiny"))
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1 and rc.is_complete(results[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["random-tiny"]
    _load(results[0])


def test_lost_race_keeps_winner(tmp_path):
    path = make_random_checkpoint(tmp_path / "m", seed=0)
    before = (path / "model.safetensors").read_bytes()
    rc._build(path, "tiny", 1, {}, replace=False)  # as if another process renamed first
    assert (path / "model.safetensors").read_bytes() == before
    make_random_checkpoint(path, seed=1)  # explicit rebuild into an existing folder replaces it
    assert (path / "model.safetensors").read_bytes() != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_existing_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    path = make_random_checkpoint(tmp_path / "empty")
    assert rc.is_complete(path) and sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_unknown_shape_and_field(tmp_path):
    with pytest.raises(ValueError, match="tiny"):
        make_random_checkpoint(tmp_path / "x", shape="qwen3-99b")
    with pytest.raises(ValueError, match="qwen3-0.6b"):
        default_checkpoint("nope")
    with pytest.raises(ValueError):
        make_random_checkpoint(tmp_path / "x", hidden_sise=32)
    assert not (tmp_path / "x").exists()
