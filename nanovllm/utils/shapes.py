"""Configs of random-weight checkpoints by name: tiny ones for CPU tests (one per family) and the published
configs' numbers of real models for benchmarks (`bench.py --shape`). `model_type` picks the family ("qwen3" when
absent); `dtype` is the dtype the weights are stored in."""

_LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192, rope_theta=500000.0)
# the widths every tiny CPU test shape shares (each family adds what it has of its own)
_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=512, max_position_embeddings=4096, dtype="float32")
SHAPES: dict[str, dict] = {
    "tiny": dict(_TINY, head_dim=16, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
                 attention_bias=False),
    # tiny CPU test shapes of the other families; llama3 rope with a short original context, so that
    # positions of a test prompt reach all three of its frequency bands
    "tiny-llama": dict(
        _TINY, model_type="llama", head_dim=16,
        rope_parameters=dict(_LLAMA3_ROPE, factor=8.0, original_max_position_embeddings=256),
        rms_norm_eps=1e-5, tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
    ),
    "tiny-mistral": dict(_TINY, model_type="mistral", head_dim=16, rope_theta=1e6, sliding_window=None,
                         rms_norm_eps=1e-5, tie_word_embeddings=False),
    "tiny-qwen2": dict(_TINY, model_type="qwen2", rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "tiny-qwen3-moe": dict(
        _TINY, model_type="qwen3_moe", intermediate_size=96, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], head_dim=16,
        rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
    ),
    "qwen3-0.6b": dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False,
        dtype="bfloat16",
    ),
    "llama-3.2-1b": dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
        rope_parameters=dict(_LLAMA3_ROPE, factor=32.0), rms_norm_eps=1e-5, tie_word_embeddings=True,
        attention_bias=False, mlp_bias=False, dtype="bfloat16",
    ),
    "llama-3.1-8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
        rope_parameters=dict(_LLAMA3_ROPE, factor=8.0), rms_norm_eps=1e-5, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False, dtype="bfloat16",
    ),
    "qwen2.5-0.5b": dict(
        model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
        use_sliding_window=False, sliding_window=32768, max_window_layers=21, rms_norm_eps=1e-6,
        tie_word_embeddings=True, dtype="bfloat16",
    ),
    "mistral-7b": dict(  # v0.3: no sliding window, 32768-token vocabulary
        model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32768,
        max_position_embeddings=32768, rope_theta=1e6, sliding_window=None, rms_norm_eps=1e-5,
        tie_word_embeddings=False, dtype="bfloat16",
    ),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
        attention_bias=False, dtype="bfloat16",
    ),
}
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
