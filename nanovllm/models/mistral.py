"""MistralForCausalLM: Llama's layers without biases, plus `sliding_window`.

Attention here always sees the whole context, which equals a sliding window of w tokens as long as no sequence
is longer than w: so a window of null or of at least `max_model_len` runs, and a shorter one is refused by
`DecoderForCausalLM.check` with both values in the message.
"""
from nanovllm.models.decoder import DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    pass  # the shared decoder's defaults are Mistral: no biases, no q/k norm, dense silu MLP
