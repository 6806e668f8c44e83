"""Model classes by the Hugging Face `architectures` name in config.json."""
from transformers import PretrainedConfig

from nanovllm.models.decoder import DecoderForCausalLM
from nanovllm.models.llama import LlamaForCausalLM
from nanovllm.models.mistral import MistralForCausalLM
from nanovllm.models.qwen2 import Qwen2ForCausalLM
from nanovllm.models.qwen3 import Qwen3ForCausalLM
from nanovllm.models.qwen3_moe import Qwen3MoeForCausalLM

MODELS: dict[str, type[DecoderForCausalLM]] = {cls.__name__: cls for cls in (
    LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM)}


def model_class(hf_config: PretrainedConfig) -> type[DecoderForCausalLM]:
    names = getattr(hf_config, "architectures", None) or []
    for name in names:
        if name in MODELS:
            return MODELS[name]
    raise ValueError(f"architectures={names} is not supported; supported ones are {sorted(MODELS)}")


def check_model_config(hf_config: PretrainedConfig, max_model_len: int):
    """Raise ValueError, before anything is allocated, for a config that this engine cannot run as given."""
    model_class(hf_config).check(hf_config, max_model_len)
