"""LlamaForCausalLM (Llama 2, 3, 3.1, 3.2): q/k/v/o biases when `attention_bias`, MLP biases when `mlp_bias`.

Llama 3.1/3.2's "llama3" rope and Llama 2 fine-tunes' "linear" rope live in `layers/rotary_embedding.py`; Llama
3.2 1B/3B tie the LM head to the embedding (`tie_word_embeddings`), as the shared decoder does when asked.
"""
from nanovllm.models.decoder import AttentionOptions, DecoderForCausalLM, MLPOptions


class LlamaForCausalLM(DecoderForCausalLM):

    @classmethod
    def attention_options(cls, config) -> AttentionOptions:
        bias = getattr(config, "attention_bias", False)
        return AttentionOptions(qkv_bias=bias, o_bias=bias)

    @classmethod
    def mlp_options(cls, config, layer: int) -> MLPOptions:
        return MLPOptions(config.intermediate_size, bias=getattr(config, "mlp_bias", False))
