"""Engine configuration: every knob, validated once, with errors that name the field and its limit."""
import os
from dataclasses import dataclass, field, fields

import torch
from transformers import AutoConfig, PretrainedConfig

from nanovllm.layers.attention import BACKEND_NAMES, FP8_DTYPE
from nanovllm.models import check_model_config
from nanovllm.utils.loader import LOAD_FORMATS

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# vLLM's names; "auto": the model's dtype
KV_CACHE_DTYPES = {"auto": None, "fp8": FP8_DTYPE, "fp8_e4m3": FP8_DTYPE}


@dataclass(slots=True)
class Config:
    model: str
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    prefill_first: bool = False  # nano-vllm's steps, not mixed ones
    async_scheduling: bool = True  # overlap host and device
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"
    seed: int = 0
    dist_port: int = 0
    load_format: str = "auto"
    hf_config: PretrainedConfig | None = field(default=None, repr=False)
    eos_token_ids: tuple[int, ...] = ()  # set by the engine

    def __post_init__(self):
        if not os.path.isdir(self.model):
            raise FileNotFoundError(f"model folder {self.model!r} does not exist")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise FileNotFoundError(f"model folder {self.model!r} has no config.json")
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "kvcache_block_size"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, minimum=1, maximum=8)
        _check_int("num_kvcache_blocks", self.num_kvcache_blocks, minimum=-1)
        _check_int("seed", self.seed, minimum=0, maximum=2**63 - 1)  # an int64 on the device
        _check_int("dist_port", self.dist_port, minimum=0, maximum=65535)
        if self.num_kvcache_blocks == 0:
            raise ValueError("num_kvcache_blocks=0: use -1 to size the cache from memory, or a positive cap")
        if self.kvcache_block_size % 16:
            raise ValueError(f"kvcache_block_size={self.kvcache_block_size} must be a positive multiple of 16")
        _check_type("gpu_memory_utilization", self.gpu_memory_utilization, (int, float), "a number")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        for name in ("enforce_eager", "prefill_first", "async_scheduling"):
            _check_type(name, getattr(self, name), bool, "a bool")
        for name in ("device", "dtype", "attention_backend", "kv_cache_dtype", "load_format"):
            _check_type(name, getattr(self, name), str, "a str")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device={self.device!r} must be one of 'auto', 'cuda', 'cpu'")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        elif self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for, but torch sees no CUDA device")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be 'auto' or one of {sorted(DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} must be one of {list(KV_CACHE_DTYPES)}")
        if self.attention_backend not in ("auto", *BACKEND_NAMES):
            raise ValueError(f"attention_backend={self.attention_backend!r} is unknown; valid ones are "
                             f"{['auto', *BACKEND_NAMES]}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={self.load_format!r} must be one of {list(LOAD_FORMATS)}")

        try:
            self.hf_config = AutoConfig.from_pretrained(self.model)
        except OSError as e:  # not JSON (transformers' OSError)
            raise ValueError(f"{self.model}/config.json: {e}") from e
        self.max_model_len = min(self.max_model_len, self.hf_config.max_position_embeddings)
        check_model_config(self.hf_config, self.max_model_len)
        tp = self.tensor_parallel_size
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size"):
            value = getattr(self.hf_config, name, None)
            if value is None or value % tp == 0:  # the vocabulary need not divide: it is padded
                continue
            if name != "num_key_value_heads":
                raise ValueError(f"the model's {name}={value} does not divide by tensor_parallel_size={tp}")
            if tp % value:
                raise ValueError(f"the model's num_key_value_heads={value} neither divides by tensor_parallel_size="
                                 f"{tp} nor divides it (to replicate each KV head on {tp} / {value} ranks)")
        if self.device == "cuda" and tp > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={tp} needs {tp} GPUs; {torch.cuda.device_count()} are visible")
        if self.dtype == "auto":
            self.dtype = checkpoint_dtype(self.hf_config) if self.device == "cuda" else "float32"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.torch_dtype

    @classmethod
    def default(cls, name: str):
        """A field's default (a slotted class's attribute is a descriptor)."""
        return next(f.default for f in fields(cls) if f.name == name)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "Config":
        known = {f.name for f in fields(cls)} - {"model", "hf_config", "eos_token_ids"}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; valid ones are {sorted(known)}")
        return cls(model, **kwargs)


def checkpoint_dtype(hf_config: PretrainedConfig) -> str:
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "bfloat16"
    name = str(dtype).removeprefix("torch.")
    return name if name in DTYPES else "bfloat16"


def _check_type(name: str, value, kind, what: str):
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise TypeError(f"{name}={value!r} must be {what}")


def _check_int(name: str, value, minimum: int, maximum: int | None = None):
    _check_type(name, value, int, "an int")
    if value < minimum or (maximum is not None and value > maximum):
        limit = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name}={value} must be {limit}")
