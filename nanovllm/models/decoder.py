"""The decoder every supported family shares: pre-norm layers of grouped-query attention with rope and a gated
MLP (dense, or a mixture of experts), RMSNorm, a vocabulary-parallel embedding and LM head (tied or not).

A family subclasses `DecoderForCausalLM` and states only what differs: `attention_options` (q/k RMSNorm,
biases), `mlp_options` of each layer (dense size and bias, or experts) and any extra `check`. The random
checkpoints of `utils/random_checkpoint.py` read the same options, so their tensors are the family's.
"""
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers import triton_skinny
from nanovllm.layers.activation import gated_activation
from nanovllm.layers.attention import Attention, AttentionMetadata
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.moe import SparseMoeBlock
from nanovllm.layers.rotary_embedding import RotaryEmbedding, get_rope, rope_inv_freq
from nanovllm.layers.triton_rope_store import RopeStoreArgs, rope_store

MOE_ACTIVATIONS = ("silu", "swish")  # the fused kernel computes silu(gate) * up


@dataclass(frozen=True, slots=True)
class AttentionOptions:
    qk_norm: bool = False  # RMSNorm over each head of q and k, before rope (Qwen3)
    qkv_bias: bool = False
    o_bias: bool = False


@dataclass(frozen=True, slots=True)
class MLPOptions:
    intermediate_size: int  # per expert when num_experts > 0
    bias: bool = False
    num_experts: int = 0  # 0: a dense MLP
    top_k: int = 0
    renormalize: bool = False  # routing weights of the top_k renormalised to sum to 1 (norm_topk_prob)


def head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window(config: PretrainedConfig) -> int | None:
    """The attention window that some layer uses, read as transformers reads it; None when all see everything."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return window


class DecoderAttention(nn.Module):

    def __init__(self, config: PretrainedConfig, options: AttentionOptions, rotary_emb: RotaryEmbedding):
        super().__init__()
        dim = head_dim(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=options.qkv_bias)
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, dim
        self.q_size, self.kv_size = self.num_heads * dim, self.num_kv_heads * dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * dim, config.hidden_size, bias=options.o_bias)
        self.rotary_emb = rotary_emb  # one module shared by every layer: its cos/sin table is built once
        self.attn = Attention(self.num_heads, dim, dim ** -0.5, self.num_kv_heads)
        self.qk_norm = options.qk_norm
        if options.qk_norm:
            self.q_norm = RMSNorm(dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(dim, eps=config.rms_norm_eps)

    def project(self, positions: torch.Tensor, hidden_states: torch.Tensor, slot_mapping: torch.Tensor,
                norm: RMSNorm | None = None):
        """The attention's inputs: q and k ([tokens, heads, head_dim]) normed and rotated, and v, projected from
        hidden_states, or from norm(hidden_states) when given (the layer's input norm over the residual stream).
        Where the attention says `fused_store`, one kernel does the q/k norms and rope and stores k and v at
        `slot_mapping`: the projection's own where it takes few rows (`triton_skinny.fuses_rope`), else the next."""
        attn, proj = self.attn, self.qkv_proj
        store = None
        if attn.fused_store:
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else (None, None, 0.0)
            store = RopeStoreArgs(positions, self.rotary_emb.cos_sin_cache, *norms, attn.k_cache, attn.v_cache,
                                  slot_mapping, attn.k_scale, attn.v_scale)
        in_projection = store is not None and triton_skinny.fuses_rope(hidden_states, proj.weight, self.head_dim)
        if in_projection:
            qkv = triton_skinny.skinny_linear(hidden_states, proj.weight, proj.bias, rope=store,
                                              norm=None if norm is None else (norm.weight, norm.eps))
        else:
            qkv = proj(hidden_states, norm=norm)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if store is not None:
            return (q if in_projection else rope_store(q, k, v, *store)), k, v
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return q, k, v


class DenseMLP(nn.Module):

    def __init__(self, hidden_size: int, options: MLPOptions, hidden_act: str):
        super().__init__()
        size = options.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [size, size], bias=options.bias)
        self.down_proj = RowParallelLinear(size, hidden_size, bias=options.bias)
        self.act_fn = gated_activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))

    def fused(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """x + forward(norm(x)), for few rows: two skinny kernels (norm + gate/up + silu, down + residual)."""
        return self.down_proj(self.gate_up_proj(x, norm=norm, act=self.act_fn), residual=x)


class DecoderLayer(nn.Module):

    def __init__(self, config: PretrainedConfig, attention: AttentionOptions, mlp: MLPOptions,
                 rotary_emb: RotaryEmbedding):
        super().__init__()
        self.self_attn = DecoderAttention(config, attention, rotary_emb)
        if mlp.num_experts:
            self.mlp = SparseMoeBlock(config.hidden_size, mlp.intermediate_size, mlp.num_experts, mlp.top_k,
                                      mlp.renormalize)
        else:
            self.mlp = DenseMLP(config.hidden_size, mlp, config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def after_attention(self, x: torch.Tensor, residual: torch.Tensor, next_norm: RMSNorm):
        """From this layer's attention output `x` to the next norm's input: (hidden states, residual stream,
        the norm still to apply to the hidden states or None). Few rows (a decode step's, `triton_skinny.takes`)
        add each residual in the projection before it and leave each norm to the projection after it; more rows
        add each residual in the norm after it (one compiled kernel)."""
        if triton_skinny.takes(x):
            residual = self.self_attn.o_proj(x, residual=residual)
            if isinstance(self.mlp, DenseMLP):
                residual = self.mlp.fused(residual, self.post_attention_layernorm)
            else:
                residual = residual + self.mlp(self.post_attention_layernorm(residual))
            return residual, residual, next_norm
        hidden, residual = self.post_attention_layernorm(self.self_attn.o_proj(x), residual)
        hidden, residual = next_norm(self.mlp(hidden), residual)
        return hidden, residual, None


class DecoderModel(nn.Module):

    def __init__(self, config: PretrainedConfig, attention: AttentionOptions, mlps: list[MLPOptions]):
        super().__init__()
        rotary_emb = get_rope(config, head_dim(config))
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config, attention, mlp, rotary_emb) for mlp in mlps])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, positions, meta):
        x, residual = input_ids, None
        for i, layer in enumerate(self.layers):
            q, k, v, residual = self.piece(i, positions, meta.slot_mapping, x, residual)
            x = layer.self_attn.attn(q, k, v, meta)
        return self.piece(len(self.layers), positions, meta.slot_mapping, x, residual)

    def piece(self, i: int, positions, slot_mapping, x, residual):
        """The forward between two attentions, which reads no attention metadata but the cache slots (for a
        fused KV store): from the output `x` of layer i - 1's attention (for i = 0: the input ids) to the inputs
        of layer i's, returned as (q, k, v, residual); for i = num_layers, to the final hidden states. Piecewise
        CUDA graphs capture these pieces."""
        if i == 0:
            residual = self.embed_tokens(x)
            hidden, norm = residual, self.layers[0].input_layernorm
        else:
            norm = self.layers[i].input_layernorm if i < len(self.layers) else self.norm
            hidden, residual, norm = self.layers[i - 1].after_attention(x, residual, norm)
            if i == len(self.layers):
                return hidden if norm is None else norm(hidden)
        return *self.layers[i].self_attn.project(positions, hidden, slot_mapping, norm), residual


class DecoderForCausalLM(nn.Module):
    """A causal LM of the shared decoder; subclasses override the class methods below."""
    # checkpoint name -> (parameter name, shard) for projections that are fused here
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        return AttentionOptions()

    @classmethod
    def mlp_options(cls, config: PretrainedConfig, layer: int) -> MLPOptions:
        return MLPOptions(config.intermediate_size)

    @classmethod
    def check(cls, config: PretrainedConfig, max_model_len: int | None = None):
        """Raise ValueError for a config this engine would run wrongly (before any weight is allocated)."""
        quantization = getattr(config, "quantization_config", None)
        if quantization:  # its weights would load as plain ones, unscaled, or fail on tensors no layer has
            method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
            raise ValueError(f"quantized checkpoints (quantization_config quant_method={method!r}) are not supported")
        rope_inv_freq(config, head_dim(config))
        gated_activation(config.hidden_act)
        window = sliding_window(config)
        if window is not None and max_model_len is not None and window < max_model_len:
            raise ValueError(f"sliding_window={window} is shorter than max_model_len={max_model_len}: sliding-window "
                             f"attention is not implemented, so pass max_model_len <= {window}")
        for layer in range(config.num_hidden_layers):
            mlp = cls.mlp_options(config, layer)
            if mlp.num_experts and config.hidden_act not in MOE_ACTIVATIONS:
                raise ValueError(f"hidden_act={config.hidden_act!r} is not supported in mixture-of-experts layers; "
                                 f"supported activations there are {list(MOE_ACTIVATIONS)}")
            if mlp.num_experts and not 0 < mlp.top_k <= mlp.num_experts:
                raise ValueError(f"num_experts_per_tok={mlp.top_k} must be in [1, num_experts={mlp.num_experts}]")

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.check(config)
        self.config = config
        mlps = [self.mlp_options(config, layer) for layer in range(config.num_hidden_layers)]
        self.model = DecoderModel(config, self.attention_options(config), mlps)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden_states: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
        return self.lm_head(hidden_states, out)
