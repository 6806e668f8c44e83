"""The weight loader: sharded checkpoints as transformers writes them, each family's names, mistakes as errors
that name the tensor, and load_format="dummy" (random weights in memory, equal to the random checkpoint's)."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from nanovllm import LLM, SamplingParams
from nanovllm.utils.random_checkpoint import checkpoint_bytes, make_random_checkpoint
from tests.test_models import PROMPTS, check_against_hf

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def greedy_tokens(path, **engine_args) -> list[list[int]]:
    with LLM(str(path), kvcache_block_size=16, **engine_args) as llm:
        return [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def reshard_with_transformers(src, dst):
    """The same weights saved by transformers in several shards with a model.safetensors.index.json."""
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.save_pretrained(dst, max_shard_size="60KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)
    assert (dst / "model.safetensors.index.json").is_file() and len(list(dst.glob("*.safetensors"))) > 3
    return dst


@pytest.mark.parametrize("shape", ["tiny-qwen3-moe", "tiny-llama"])
def test_sharded_checkpoint(tmp_path, shape):
    single = make_random_checkpoint(tmp_path / "single", shape, tie_word_embeddings=False)
    sharded = reshard_with_transformers(single, tmp_path / "sharded")
    # a file the index does not name (Mistral folders hold a consolidated.safetensors in other names) is not read
    save_file({"tok_embeddings.weight": torch.zeros(2, 2)}, str(sharded / "consolidated.safetensors"))
    assert check_against_hf(sharded) and greedy_tokens(sharded) == greedy_tokens(single)


def break_checkpoint(tmp_path, edit, shape="tiny-qwen3-moe"):
    path = make_random_checkpoint(tmp_path / "m", shape)
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def test_missing_expert_is_named(tmp_path):
    path = break_checkpoint(tmp_path, lambda t: t.pop("model.layers.1.mlp.experts.5.up_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks weights for .*model.layers.1.mlp.experts.gate_up_proj "
                                         r"\(parts \[\(5, 'up'\)\]\)"):
        LLM(str(path))


def test_missing_k_proj_is_named(tmp_path):
    path = break_checkpoint(tmp_path, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"), "tiny-llama")
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.qkv_proj.weight \(parts \['k'\]\)"):
        LLM(str(path))


def test_missing_parameter_is_named(tmp_path):
    """A tensor missing altogether (not one part of a fused projection) is an error too, never an uninitialised
    parameter."""
    path = break_checkpoint(tmp_path, lambda t: t.pop("model.norm.weight"), "tiny-llama")
    with pytest.raises(ValueError, match=r"lacks weights for \['model.norm.weight'\]"):
        LLM(str(path))


def test_tensors_that_are_no_parameters_are_skipped(tmp_path):
    """A tied model's checkpoint that still stores lm_head.weight, and older Llama checkpoints' rotary_emb.inv_freq
    (computed here): the same model as without them."""
    def extras(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    with_extras = break_checkpoint(tmp_path, extras, "tiny-llama")
    assert greedy_tokens(with_extras) == greedy_tokens(make_random_checkpoint(tmp_path / "plain", "tiny-llama"))


def test_stacked_experts_checkpoint(tmp_path):
    """Experts stored stacked, as transformers 5 holds them in memory (`mlp.experts.gate_up_proj` [experts,
    2 * intermediate, hidden], gates then ups, and `mlp.experts.down_proj`), not one tensor per expert."""
    path = make_random_checkpoint(tmp_path / "moe", "tiny-qwen3-moe")
    tensors = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    assert tensors["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    check_against_hf(path)


def test_expert_past_num_experts(tmp_path):
    def extra_expert(tensors):
        expert_0 = tensors["model.layers.0.mlp.experts.0.down_proj.weight"]
        tensors["model.layers.0.mlp.experts.8.down_proj.weight"] = expert_0.clone()
    with pytest.raises(ValueError, match=r"experts.8.down_proj.weight.*expert 8 is out of range: .*num_experts=8"):
        LLM(str(break_checkpoint(tmp_path, extra_expert)))


def test_wrong_shape_is_named(tmp_path):
    def transpose(tensors):
        name = "model.layers.1.mlp.experts.2.gate_proj.weight"
        tensors[name] = tensors[name].t().contiguous()
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.experts.2.gate_proj.weight' of shape \[64, 32\].*"
                                         r"does not fit parameter 'model.layers.1.mlp.experts.gate_up_proj'"):
        LLM(str(break_checkpoint(tmp_path, transpose)))

    def short_router(tensors):
        tensors["model.layers.0.mlp.gate.weight"] = tensors["model.layers.0.mlp.gate.weight"][:1]
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.gate.weight' of shape \[1, 64\]"):
        LLM(str(break_checkpoint(tmp_path, short_router)))


def test_unknown_tensor_is_named(tmp_path):
    path = break_checkpoint(tmp_path, lambda t: t.update({"model.layers.0.mlp.shared_expert.weight": torch.ones(2)}))
    with pytest.raises(ValueError, match="'model.layers.0.mlp.shared_expert.weight' .* matches no model parameter"):
        LLM(str(path))


def test_sharded_checkpoint_mistakes(tmp_path):
    sharded = reshard_with_transformers(make_random_checkpoint(tmp_path / "single", "tiny"), tmp_path / "sharded")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    first, second = sorted(set(index["weight_map"].values()))[:2]
    # the same tensor in two shards
    duplicate = load_file(sharded / first)
    name = next(iter(duplicate))
    save_file({**load_file(sharded / second), name: duplicate[name]}, str(sharded / second))
    with pytest.raises(ValueError, match=f"checkpoint tensor '{name}' is in both"):
        LLM(str(sharded))
    (sharded / first).unlink()  # a shard the index names is gone
    with pytest.raises(FileNotFoundError, match=f"names shard file.*{first}"):
        LLM(str(sharded))


def test_an_index_without_tensors_is_an_error_that_says_so(tmp_path):
    """A model.safetensors.index.json whose weight_map is empty (or missing) is named as the problem, rather than
    read as a checkpoint of no files (which would then lack every weight)."""
    from nanovllm.utils.loader import checkpoint_files
    path = make_random_checkpoint(tmp_path / "m", "tiny-llama", with_weights=False)
    for index in ({"weight_map": {}}, {"metadata": {}}):
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(ValueError, match="model.safetensors.index.json' has no weight_map"):
            checkpoint_files(str(path))


def test_no_weights_is_an_error_that_names_dummy(tmp_path):
    path = make_random_checkpoint(tmp_path / "m", "tiny-llama", with_weights=False)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors files.*load_format='dummy'"):
        LLM(str(path))
    with pytest.raises(ValueError, match="load_format='npcache' must be one of"):
        LLM(str(path), load_format="npcache")


def test_dummy_weights_are_the_random_checkpoint(tmp_path):
    """No file but config.json and the tokenizer; on CPU the same tensors a random checkpoint of the config holds,
    so the dummy model is a real model (greedy equal to HF's on that checkpoint), at TP=1 and at TP=2, where
    every rank makes the same full tensors and keeps its own shard."""
    shape = "tiny-qwen3-moe"
    with_weights = make_random_checkpoint(tmp_path / "weights", shape, attention_bias=True, mlp_only_layers=[0])
    dummy = make_random_checkpoint(tmp_path / "dummy", shape, attention_bias=True, mlp_only_layers=[0],
                                   with_weights=False)
    assert not list(dummy.glob("*.safetensors"))
    expected = greedy_tokens(with_weights)
    assert greedy_tokens(dummy, load_format="dummy") == expected
    assert greedy_tokens(dummy, load_format="dummy", tensor_parallel_size=2) == expected


def test_checkpoint_bytes_of_the_benchmark_shapes():
    # published sizes: Llama 3.2 1B 1.24B parameters, Llama 3.1 8B 8.03B, Qwen2.5 0.5B 0.49B, Mistral 7B v0.3
    # 7.25B, Qwen3-30B-A3B 30.5B; all in bfloat16
    sizes = {shape: checkpoint_bytes(shape) / 2e9 for shape in
             ("llama-3.2-1b", "llama-3.1-8b", "qwen2.5-0.5b", "mistral-7b", "qwen3-30b-a3b")}
    assert sizes == pytest.approx({"llama-3.2-1b": 1.236, "llama-3.1-8b": 8.030, "qwen2.5-0.5b": 0.494,
                                   "mistral-7b": 7.248, "qwen3-30b-a3b": 30.532}, rel=2e-3)
    # Qwen3-0.6B (bench.py's default shape): 0.44B parameters besides the embedding, which its LM head shares
    assert 0.435 <= checkpoint_bytes("qwen3-0.6b") / 2e9 - 151936 * 1024 / 1e9 < 0.445


@pytest.mark.parametrize("shape", ["llama-3.2-1b", "llama-3.1-8b", "qwen2.5-0.5b", "mistral-7b", "qwen3-30b-a3b"])
def test_benchmark_shapes_load_on_the_meta_device(shape):
    """Every tensor of the shape's (dummy) checkpoint finds its parameter with the right shape, and none is
    missing, without allocating a byte; the dense ones also have transformers' own names and shapes."""
    from nanovllm.models import model_class
    from nanovllm.utils.loader import load_tensors
    from nanovllm.utils.random_checkpoint import _resolve_config, hf_config, param_specs

    config = hf_config(_resolve_config(shape, {}))
    specs = {name: torch.Size(size) for name, size, _, _ in param_specs(config)}
    with torch.device("meta"):
        model = model_class(config)(config)
        load_tensors(model, ((name, "meta", torch.empty(size)) for name, size in specs.items()), shape)
        if shape != "qwen3-30b-a3b":  # transformers keeps MoE experts stacked in memory: other names
            hf = AutoModelForCausalLM.from_config(config)
            expected = {name: t.shape for name, t in hf.state_dict().items()
                        if not (config.tie_word_embeddings and name == "lm_head.weight")}
            assert specs == expected
