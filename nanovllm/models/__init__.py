"""Model classes by the Hugging Face `architectures` name in config.json."""
from torch import nn
from transformers import PretrainedConfig

from nanovllm.models.qwen3 import Qwen3ForCausalLM

MODELS: dict[str, type[nn.Module]] = {"Qwen3ForCausalLM": Qwen3ForCausalLM}


def model_class(hf_config: PretrainedConfig) -> type[nn.Module]:
    names = getattr(hf_config, "architectures", None) or []
    for name in names:
        if name in MODELS:
            return MODELS[name]
    raise ValueError(f"architectures={names} is not supported; supported ones are {sorted(MODELS)}")
