"""The weight loader: sharded checkpoints, each family's names, mistakes named as errors, load_format="dummy"."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from nanovllm import LLM
from nanovllm.models import model_class
from nanovllm.utils.loader import checkpoint_files, load_tensors
from nanovllm.utils.random_checkpoint import (_resolve_config, checkpoint_bytes, hf_config, make_random_checkpoint,
                                              param_specs)
from tests.conftest import greedy, refuses
from tests.test_models import PROMPTS, check_against_hf

MOE, LLAMA = "tiny-qwen3-moe", "tiny-llama"
# published sizes in billions of bfloat16 parameters
BENCHMARK_SHAPES = {"llama-3.2-1b": 1.236, "llama-3.1-8b": 8.030, "qwen2.5-0.5b": 0.494, "mistral-7b": 7.248,
                    "qwen3-30b-a3b": 30.532}


def greedy_tokens(path, **engine_args):
    with LLM(str(path), kvcache_block_size=16, **engine_args) as llm:
        return [o["token_ids"] for o in llm.generate(PROMPTS, greedy(12), use_tqdm=False)]


def reshard_with_transformers(src, dst):
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).save_pretrained(dst, max_shard_size="60KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)
    assert (dst / "model.safetensors.index.json").is_file() and len(list(dst.glob("*.safetensors"))) > 3
    return dst


@pytest.mark.parametrize("shape", [MOE, LLAMA])
def test_sharded_checkpoint(tmp_path, shape):
    single = make_random_checkpoint(tmp_path / "single", shape, tie_word_embeddings=False)
    sharded = reshard_with_transformers(single, tmp_path / "sharded")
    # a file the index does not name is not read
    save_file({"tok_embeddings.weight": torch.zeros(2, 2)}, str(sharded / "consolidated.safetensors"))
    assert check_against_hf(sharded) and greedy_tokens(sharded) == greedy_tokens(single)


def break_checkpoint(tmp_path, edit, shape=MOE):
    path = make_random_checkpoint(tmp_path / "m", shape)
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def put(name, make):
    return lambda tensors: tensors.update({name: make(tensors)})


EXPERT = "model.layers.{}.mlp.experts.{}.{}_proj.weight"
GATE = "model.layers.0.mlp.gate.weight"


@pytest.mark.parametrize("shape, edit, match", [
    (MOE, lambda t: t.pop(EXPERT.format(1, 5, "up")),
     r"lacks weights for .*model.layers.1.mlp.experts.gate_up_proj \(parts \[\(5, 'up'\)\]\)"),
    (LLAMA, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"),
     r"model.layers.0.self_attn.qkv_proj.weight \(parts \['k'\]\)"),
    # missing altogether (not one part of a fused projection): never an uninitialised parameter
    (LLAMA, lambda t: t.pop("model.norm.weight"), r"lacks weights for \['model.norm.weight'\]"),
    (MOE, put(EXPERT.format(0, 8, "down"), lambda t: t[EXPERT.format(0, 0, "down")].clone()),
     r"experts.8.down_proj.weight.*expert 8 is out of range: .*num_experts=8"),
    (MOE, put(EXPERT.format(1, 2, "gate"), lambda t: t[EXPERT.format(1, 2, "gate")].t().contiguous()),
     r"'model.layers.1.mlp.experts.2.gate_proj.weight' of shape \[64, 32\].*"
     r"does not fit parameter 'model.layers.1.mlp.experts.gate_up_proj'"),
    (MOE, put(GATE, lambda t: t[GATE][:1]), r"'model.layers.0.mlp.gate.weight' of shape \[1, 64\]"),
    (MOE, put("model.layers.0.mlp.shared_expert.weight", lambda t: torch.ones(2)),
     "'model.layers.0.mlp.shared_expert.weight' .* matches no model parameter"),
], ids=["missing-expert", "missing-k", "missing-norm", "expert-8", "wrong-shape", "short-router", "unknown"])
def test_broken_checkpoint_is_named(tmp_path, shape, edit, match):
    refuses(ValueError, match, break_checkpoint(tmp_path, edit, shape))


def test_tensors_that_are_no_parameters_are_skipped(tmp_path):
    """A tied model's stored lm_head.weight and old Llama's rotary_emb.inv_freq: the same model as without them."""
    def extras(t):
        t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone(),
                  "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    with_extras = break_checkpoint(tmp_path, extras, LLAMA)
    assert greedy_tokens(with_extras) == greedy_tokens(make_random_checkpoint(tmp_path / "plain", LLAMA))


def test_stacked_experts_checkpoint(tmp_path):
    """As transformers 5 holds them (`mlp.experts.gate_up_proj`, gates then ups)."""
    path = make_random_checkpoint(tmp_path / "moe", MOE)
    tensors = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    assert tensors["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    check_against_hf(path)


def test_sharded_checkpoint_mistakes(tmp_path):
    sharded = reshard_with_transformers(make_random_checkpoint(tmp_path / "single", "tiny"), tmp_path / "sharded")
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    first, second = sorted(set(weight_map.values()))[:2]
    # the same tensor in two shards
    duplicate = load_file(sharded / first)
    name = next(iter(duplicate))
    save_file({**load_file(sharded / second), name: duplicate[name]}, str(sharded / second))
    refuses(ValueError, f"checkpoint tensor '{name}' is in both", sharded)
    (sharded / first).unlink()  # a shard the index names is gone
    refuses(FileNotFoundError, f"names shard file.*{first}", sharded)


def test_no_weights_is_an_error_that_names_dummy(tmp_path):
    """No weights, a file cut short, a wrong load_format, an index whose weight_map is empty or missing: each named."""
    path = make_random_checkpoint(tmp_path / "m", LLAMA, with_weights=False)
    refuses(FileNotFoundError, "no \\*.safetensors files.*load_format='dummy'", path)
    (path / "model.safetensors").write_bytes(b"\0" * 9)
    refuses(ValueError, "model.safetensors' is no safetensors file", path)
    refuses(ValueError, "load_format='npcache' must be one of", path, load_format="npcache")
    for index in ({"weight_map": {}}, {"metadata": {}}):
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(ValueError, match="model.safetensors.index.json' has no weight_map"):
            checkpoint_files(str(path))


def test_dummy_weights_are_the_random_checkpoint(tmp_path):
    """At TP=1 and TP=2 (each rank keeps its shard)."""
    args = dict(shape=MOE, attention_bias=True, mlp_only_layers=[0])
    with_weights = make_random_checkpoint(tmp_path / "weights", **args)
    dummy = make_random_checkpoint(tmp_path / "dummy", **args, with_weights=False)
    assert not list(dummy.glob("*.safetensors"))
    expected = greedy_tokens(with_weights)
    assert greedy_tokens(dummy, load_format="dummy") == expected
    assert greedy_tokens(dummy, load_format="dummy", tensor_parallel_size=2) == expected


def test_checkpoint_bytes_of_the_benchmark_shapes():
    sizes = {shape: checkpoint_bytes(shape) / 2e9 for shape in BENCHMARK_SHAPES}
    assert sizes == pytest.approx(BENCHMARK_SHAPES, rel=2e-3)
    # Qwen3-0.6B: 0.44B parameters besides the embedding, which its LM head shares
    assert 0.435 <= checkpoint_bytes("qwen3-0.6b") / 2e9 - 151936 * 1024 / 1e9 < 0.445


@pytest.mark.parametrize("shape", list(BENCHMARK_SHAPES))
def test_benchmark_shapes_load_on_the_meta_device(shape):
    """Every tensor finds its parameter, none missing, no byte allocated; dense ones match transformers' names."""
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
