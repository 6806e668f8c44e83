"""Qwen2ForCausalLM (Qwen2, Qwen2.5): biases on q, k and v (always), none on o; no q/k norm.

Its sliding window (`use_sliding_window`, layers from `max_window_layers` on) is handled as Mistral's is: it
runs when no sequence can be longer than the window, else it is a clear error.
"""
from nanovllm.models.decoder import AttentionOptions, DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):

    @classmethod
    def attention_options(cls, config) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True)
