"""Every supported family against Hugging Face on CPU, and the configs that must be refused."""
import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from nanovllm import LLM
from nanovllm.layers.rotary_embedding import rope_inv_freq
from nanovllm.utils.random_checkpoint import make_random_checkpoint
from tests.conftest import assert_greedy_matches_hf, greedy, refuses

LLAMA3_ROPE = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
# up to ~300 positions: past tiny-llama's llama3 original context (256)
PROMPTS = [[7] * 3, list(range(3, 60)), list(range(100, 400)), list(range(3, 60)) + [9, 9]]


def hf_model(path):
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def check_against_hf(path, **engine_args):
    hf = hf_model(path)
    with LLM(str(path), kvcache_block_size=16, **engine_args) as llm:
        outputs = llm.generate(PROMPTS, greedy(16), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        assert_greedy_matches_hf(hf, prompt, out["token_ids"])
    return outputs


FAMILIES = {
    "llama3-rope-tied": ("tiny-llama", {}),
    "llama-linear-rope-biases": ("tiny-llama", dict(
        attention_bias=True, mlp_bias=True, tie_word_embeddings=False, num_key_value_heads=1,
        rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=10000.0))),
    "llama2-plain-rope-mha": ("tiny-llama", dict(num_key_value_heads=4, head_dim=None,
                                                 rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    "mistral": ("tiny-mistral", {}),
    "qwen2": ("tiny-qwen2", {}),
    "qwen3-moe": ("tiny-qwen3-moe", {}),
    "qwen3-moe-sparse-step-and-dense-layers": ("tiny-qwen3-moe", dict(
        num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=False, num_experts=6,
        num_experts_per_tok=3)),
    "qwen3-moe-all-experts": ("tiny-qwen3-moe", dict(num_experts=4, num_experts_per_tok=4)),
    "llama-mlp-bias-only": ("tiny-llama", dict(mlp_bias=True)),  # each bias option reads its own field
    # so large that every RMSNorm shows in the tokens whether it uses the eps
    "qwen3-large-rms-norm-eps": ("tiny", dict(rms_norm_eps=0.1)),
    "qwen3-wide-heads": ("tiny", dict(head_dim=32)),  # wider than hidden / heads, as Qwen3's
    "llama-gelu-tanh": ("tiny-llama", dict(hidden_act="gelu_pytorch_tanh")),
}


def family_checkpoint(tmp_path, name):
    shape, overrides = FAMILIES[name]
    return make_random_checkpoint(tmp_path / name, shape, **overrides)


@pytest.mark.parametrize("name", FAMILIES)
def test_family_matches_hf(tmp_path, name):
    check_against_hf(family_checkpoint(tmp_path, name))


def test_logprobs_follow_the_final_norms_eps(tmp_path):
    """The final norm's eps scales a position's logits alike: greedy tokens cannot show it, logprobs do."""
    path, prompt = family_checkpoint(tmp_path, "qwen3-large-rms-norm-eps"), PROMPTS[1]
    with LLM(str(path), kvcache_block_size=16) as llm:
        out = llm.generate([prompt], greedy(4, logprobs=0), use_tqdm=False)[0]
    with torch.no_grad():
        expected = hf_model(path)(torch.tensor([prompt + out["token_ids"]])).logits[0, len(prompt) - 1:-1]
    for row, token, entry in zip(expected.log_softmax(-1), out["token_ids"], out["logprobs"]):
        assert entry[token] == pytest.approx(row[token].item(), abs=1e-4)


def test_qwen3_moe_layers_follow_the_config(tmp_path):
    path = family_checkpoint(tmp_path, "qwen3-moe-sparse-step-and-dense-layers")
    with LLM(str(path), kvcache_block_size=16) as llm:
        layers = llm.model_runner.model.model.layers
        # (i + 1) % decoder_sparse_step == 0, not mlp_only
        assert [type(layer.mlp).__name__ for layer in layers] == ["DenseMLP", "SparseMoeBlock", "DenseMLP", "DenseMLP"]
        assert layers[1].mlp.experts.gate_up_proj.shape == (6, 64, 64)


def rewrite_config(path, edit=lambda config: None, **fields):
    config = json.loads((path / "config.json").read_text())
    edit(config)
    config.update(fields)
    (path / "config.json").write_text(json.dumps(config))


def test_legacy_rope_scaling_config(tmp_path):
    """A config.json written by older transformers: `rope_scaling` with "type", `rope_theta` at the top."""
    path = make_random_checkpoint(tmp_path / "legacy", "tiny-llama")
    rewrite_config(path, lambda config: config.pop("rope_parameters"), rope_theta=500000.0,
                   rope_scaling=dict(LLAMA3_ROPE, type="llama3", original_max_position_embeddings=256))
    check_against_hf(path)


@pytest.mark.parametrize("rope", [
    dict(rope_type="default", rope_theta=10000.0),
    dict(rope_type="linear", factor=2.5, rope_theta=500000.0),
    dict(LLAMA3_ROPE, rope_type="llama3", original_max_position_embeddings=8192, rope_theta=500000.0),
    dict(rope_type="llama3", factor=32.0, low_freq_factor=2.0, high_freq_factor=8.0,
         original_max_position_embeddings=512, rope_theta=10000.0),
])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_rope_frequencies_equal_transformers(rope, head_dim):
    config = AutoConfig.for_model("llama", hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                                  max_position_embeddings=131072, rope_parameters=dict(rope))
    expected, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu") if rope["rope_type"] != "default" \
        else (1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim)), 1.0)
    assert scaling == 1.0
    assert torch.equal(rope_inv_freq(config, head_dim), expected)


def test_llama3_rope_reads_a_top_level_original_context():
    """Beside rope_scaling, as older transformers' configs hold it."""
    config = AutoConfig.for_model("llama", hidden_size=64, num_attention_heads=4, head_dim=16,
                                  max_position_embeddings=131072, original_max_position_embeddings=256,
                                  rope_parameters=dict(LLAMA3_ROPE, rope_type="llama3", rope_theta=500000.0))
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    legacy = dict(rope_scaling=dict(LLAMA3_ROPE, type="llama3"), rope_theta=500000.0, max_position_embeddings=131072)
    assert torch.equal(rope_inv_freq(SimpleNamespace(**legacy, original_max_position_embeddings=256), 16), expected)
    assert not torch.equal(rope_inv_freq(SimpleNamespace(**legacy), 16), expected)


@pytest.mark.parametrize("in_rope_parameters", [None, 1024])
def test_llama3_rope_takes_a_top_level_original_context_first(tmp_path, in_rope_parameters):
    """At the top of config.json (as Phi-3's), as in HF's model."""
    def move(config):
        config["original_max_position_embeddings"] = config["rope_parameters"].pop("original_max_position_embeddings")
        if in_rope_parameters is not None:
            config["rope_parameters"]["original_max_position_embeddings"] = in_rope_parameters
    path = make_random_checkpoint(tmp_path / "llama", "tiny-llama")
    rewrite_config(path, move)
    check_against_hf(path)


def test_partial_rotary_factor_is_an_error():
    """Never run over the whole head, wherever the factor sits."""
    for where in (dict(partial_rotary_factor=0.5), dict(rope_scaling=dict(partial_rotary_factor=0.5))):
        config = SimpleNamespace(rope_theta=10000.0, max_position_embeddings=64, **where)
        with pytest.raises(ValueError, match="partial_rotary_factor=0.5 is not supported"):
            rope_inv_freq(config, 16)


def test_mistral_sliding_window(tmp_path):
    path = make_random_checkpoint(tmp_path / "window", "tiny-mistral", sliding_window=320)
    refuses(ValueError, "sliding_window=320 is shorter than max_model_len=4096", path)
    # a window no shorter than any sequence is full attention: it runs, as HF
    check_against_hf(path, max_model_len=320)


def test_qwen2_sliding_window_layers(tmp_path):
    path = make_random_checkpoint(tmp_path / "qwen2", "tiny-qwen2", use_sliding_window=True, sliding_window=128,
                                  max_window_layers=1)
    refuses(ValueError, "sliding_window=128 is shorter than max_model_len=1024", path, max_model_len=1024)
    # use_sliding_window false (Qwen2.5): no limit
    path = make_random_checkpoint(tmp_path / "off", "tiny-qwen2", use_sliding_window=False, sliding_window=128)
    LLM(str(path), max_model_len=1024).close()


def test_sliding_window_as_older_transformers_configs_hold_it():
    """transformers 4 kept `sliding_window` set when `use_sliding_window` was false: no limit then."""
    from nanovllm.models.decoder import sliding_window

    def window(**config):
        return sliding_window(SimpleNamespace(sliding_window=4096, **config))
    assert window(use_sliding_window=False) is None
    assert window(use_sliding_window=True) == 4096
    assert window() == 4096  # Mistral has no switch
    assert window(layer_types=["full_attention"] * 2) is None


def test_unknown_rope_type_and_activation_are_errors(tmp_path):
    path = make_random_checkpoint(tmp_path / "m", "tiny-llama")
    rewrite_config(path, rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=10000.0,
                                              original_max_position_embeddings=256))
    refuses(ValueError, r"rope_type='yarn' is not supported; .*'default', 'linear', 'llama3'", path)
    # transformers 5 refuses this config.json itself; older ones pass it on
    legacy = SimpleNamespace(rope_scaling=dict(type="llama3", factor=8.0), rope_theta=1e4, max_position_embeddings=64)
    with pytest.raises(ValueError, match="rope_type='llama3' needs 'low_freq_factor'"):
        rope_inv_freq(legacy, 16)
    rewrite_config(path, rope_parameters=dict(rope_type="default", rope_theta=10000.0), hidden_act="relu2")
    refuses(ValueError, r"hidden_act='relu2' is not supported; .*'silu'", path)
    rewrite_config(path, hidden_act="silu", quantization_config=dict(quant_method="fp8", fmt="e4m3"))
    refuses(ValueError, r"quantized checkpoints \(quantization_config quant_method='fp8'\)", path)
    moe = make_random_checkpoint(tmp_path / "moe", "tiny-qwen3-moe")
    rewrite_config(moe, hidden_act="gelu")
    refuses(ValueError, "hidden_act='gelu' is not supported in mixture-of-experts layers", moe)
    rewrite_config(moe, hidden_act="silu", architectures=["GPT2LMHeadModel"])
    refuses(ValueError, r"architectures=\['GPT2LMHeadModel'\] is not supported", moe)


@pytest.mark.parametrize("hidden_act", ["silu", "swish", "gelu", "gelu_pytorch_tanh"])
def test_gated_activations_are_transformers_own(hidden_act):
    """Each `hidden_act` the engine takes means what ACT2FN means (greedy tokens cannot tell the gelus apart)."""
    from transformers.activations import ACT2FN
    from nanovllm.layers.activation import gated_activation
    gate, up = torch.randn(2, 8, 256, generator=torch.Generator().manual_seed(0)) * 3
    # to float32's rounding; the two gelus differ by 1e-3
    torch.testing.assert_close(gated_activation(hidden_act)(torch.cat([gate, up], -1)), ACT2FN[hidden_act](gate) * up)


def test_rms_norm_in_bfloat16_is_transformers_own():
    """In bf16 the norm rounds as HF's (normalized x to bf16, then times the weight); float32 models cannot tell."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    from nanovllm.layers.layernorm import RMSNorm
    gen = torch.Generator().manual_seed(0)
    ours, theirs = RMSNorm(64, 1e-6).to(torch.bfloat16), Qwen3RMSNorm(64, 1e-6).to(torch.bfloat16)
    weight = 1 + 0.1 * torch.randn(64, generator=gen)
    for norm in (ours, theirs):
        norm.weight.data.copy_(weight)
    x = (3 * torch.randn(32, 64, generator=gen)).to(torch.bfloat16)
    assert torch.equal(ours(x), theirs(x))
