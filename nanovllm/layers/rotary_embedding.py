"""Rotary position embedding (neox style, over the whole head) and the rope variants of supported checkpoints.

The rope settings come from `rope_parameters` (transformers 5) or from `rope_scaling` + `rope_theta` (config
files written by older transformers). Supported `rope_type`s: "default", "linear" (Llama 2 long-context
fine-tunes: every frequency divided by `factor`) and "llama3" (Llama 3.1/3.2: low frequencies divided by
`factor`, high ones kept, the band between interpolated). Anything else is an error, never a silent default.
"""
import math

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "llama3")


class RotaryEmbedding(nn.Module):
    """Applies rope from a cos/sin table of every position; one instance is shared by all layers of a model."""

    def __init__(self, inv_freq: torch.Tensor, max_position: int):
        super().__init__()
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq.float())
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos, sin = self.cos_sin_cache[positions].unsqueeze(-2).chunk(2, dim=-1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rope_parameters(hf_config) -> dict:
    """The rope settings as one dict with `rope_type` and `rope_theta`, whichever way the config stores them."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(hf_config, "rope_theta", None)
    if params["rope_theta"] is None:
        raise ValueError("the checkpoint's config.json gives no rope_theta (nor rope_parameters.rope_theta)")
    if params["rope_type"] == "llama3":
        # as transformers does: a top-level field wins over the dict's (Phi-3 and others keep it there; transformers
        # fills the dict with max_position_embeddings when it reads such a config), then the model's context length
        top_level = getattr(hf_config, "original_max_position_embeddings", None)
        if top_level is not None:
            params["original_max_position_embeddings"] = top_level
        params.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
    return params


def rope_inv_freq(hf_config, head_dim: int) -> torch.Tensor:
    """float32 inverse frequencies [head_dim // 2] of the config's rope, as transformers computes them."""
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type={rope_type!r} is not supported; supported rope types are {list(ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor={partial} is not supported; only rope over the whole head (1.0) is")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (float(params["rope_theta"]) ** exponents)
    if rope_type == "linear":
        return inv_freq / _field(params, "factor")
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    factor = _field(params, "factor")
    low_freq_factor, high_freq_factor = _field(params, "low_freq_factor"), _field(params, "high_freq_factor")
    original_context = _field(params, "original_max_position_embeddings")
    if high_freq_factor <= low_freq_factor:
        raise ValueError(f"llama3 rope needs high_freq_factor ({high_freq_factor}) > low_freq_factor "
                         f"({low_freq_factor})")
    wavelength = 2 * math.pi / inv_freq
    # wavelengths longer than the pretraining context / low_freq_factor are slowed down by `factor`; those
    # shorter than context / high_freq_factor are kept; in between, a linear blend in context / wavelength
    scaled = torch.where(wavelength > original_context / low_freq_factor, inv_freq / factor, inv_freq)
    blend = (original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - blend) * scaled / factor + blend * scaled
    in_band = ~(wavelength < original_context / high_freq_factor) & ~(wavelength > original_context / low_freq_factor)
    return torch.where(in_band, blended, scaled)


def _field(params: dict, name: str) -> float:
    if params.get(name) is None:
        raise ValueError(f"rope_type={params['rope_type']!r} needs {name!r} in rope_parameters (or rope_scaling)")
    return float(params[name])


def get_rope(hf_config, head_dim: int) -> RotaryEmbedding:
    return RotaryEmbedding(rope_inv_freq(hf_config, head_dim), hf_config.max_position_embeddings)
