"""Qwen3ForCausalLM: RMSNorm over each head of q and k before rope; q/k/v/o biases when `attention_bias`."""
from nanovllm.models.decoder import AttentionOptions, DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):

    @classmethod
    def attention_options(cls, config) -> AttentionOptions:
        bias = getattr(config, "attention_bias", False)
        return AttentionOptions(qk_norm=True, qkv_bias=bias, o_bias=bias)
