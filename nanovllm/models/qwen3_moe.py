"""Qwen3MoeForCausalLM: Qwen3's attention; the MLP of layer i is a mixture of `num_experts` experts of
`moe_intermediate_size`, `num_experts_per_tok` per token (weights renormalised when `norm_topk_prob`), unless
i is in `mlp_only_layers` or (i + 1) is not a multiple of `decoder_sparse_step`: then a dense MLP of
`intermediate_size`. The experts are `layers/moe.py`.
"""
from nanovllm.models.decoder import MLPOptions
from nanovllm.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):

    @classmethod
    def mlp_options(cls, config, layer: int) -> MLPOptions:
        num_experts = getattr(config, "num_experts", 0)
        step = getattr(config, "decoder_sparse_step", 1)
        if layer in (getattr(config, "mlp_only_layers", None) or []) or num_experts <= 0 or (layer + 1) % step:
            return MLPOptions(config.intermediate_size)
        return MLPOptions(config.moe_intermediate_size, num_experts=num_experts, top_k=config.num_experts_per_tok,
                          renormalize=bool(getattr(config, "norm_topk_prob", False)))
