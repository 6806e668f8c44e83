"""Checkpoint tensors -> model parameters, through each parameter's `weight_loader`.

Where the tensors come from (`load_format`):
- "auto" / "safetensors": the files a sharded checkpoint's `model.safetensors.index.json` names (only those: some
  folders also hold e.g. a `consolidated.safetensors` in other names), else every `*.safetensors` in the folder;
- "dummy": random tensors in the names and shapes of the model's config, made in memory on its device
  (`utils/random_checkpoint.py`: same scales; on CPU the very tensors a random checkpoint of the same config and
  seed stores), so only config.json and the tokenizer need to exist.

Names are transformers': q/k/v_proj and gate/up_proj go into the fused projections (`packed_modules_mapping`),
`mlp.experts.{e}.{gate,up,down}_proj.weight` into the stacked expert parameters, `mlp.gate` is the router.
Mistakes are errors that name the tensor: one that matches no parameter, one found twice, one whose shape does
not fit, an expert index past num_experts; and after the last file, every parameter or shard no tensor filled.
"""
import json
import os
import re
from collections.abc import Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from nanovllm.layers.linear import copy_weight

LOAD_FORMATS = ("auto", "safetensors", "dummy")
INDEX_FILE = "model.safetensors.index.json"
EXPERT_TENSOR = re.compile(r"\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
COMPUTED_BUFFERS = (".rotary_emb.inv_freq",)  # stored by some older Llama checkpoints; computed here


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor):
    copy_weight(param.data, loaded_weight)


def checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index!r} has no weight_map of tensor names to files")
        files = sorted(set(weight_map.values()))
        absent = [name for name in files if not os.path.isfile(os.path.join(path, name))]
        if absent:
            raise FileNotFoundError(f"{index!r} names shard file(s) {absent} that are not in {path!r}")
        return [os.path.join(path, name) for name in files]
    files = sorted(os.path.join(path, name) for name in os.listdir(path) if name.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path!r} (load_format='dummy' runs on random weights)")
    return files


def safetensors_tensors(path: str) -> Iterator[tuple[str, str, torch.Tensor]]:
    for file in checkpoint_files(path):
        try:
            f = safe_open(file, "pt", "cpu")
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{file!r} is no safetensors file: {e}") from e
        with f:
            for name in f.keys():
                yield name, file, f.get_tensor(name)


def dummy_tensors(model: nn.Module, seed: int = 0) -> Iterator[tuple[str, str, torch.Tensor]]:
    from nanovllm.utils.random_checkpoint import random_tensors
    device = next(model.parameters()).device
    for name, tensor in random_tensors(model.config, seed, device):
        yield name, "dummy weights", tensor


def parameter_for(name: str, packed: dict) -> tuple[str, object] | None:
    """(parameter name, shard id or None) for a checkpoint tensor; None for tensors that are not loaded."""
    if name.endswith(COMPUTED_BUFFERS):
        return None
    expert = EXPERT_TENSOR.search(name)
    if expert:
        stacked = "down_proj" if expert[2] == "down" else "gate_up_proj"
        return f"{name[:expert.start()]}.experts.{stacked}", (int(expert[1]), expert[2])
    for checkpoint_name, (param_name, shard_id) in packed.items():
        if f".{checkpoint_name}." in name:
            return name.replace(f".{checkpoint_name}.", f".{param_name}."), shard_id
    return name, None


def load_model(model: nn.Module, path: str, load_format: str = "auto"):
    """Fill every parameter of `model` from the checkpoint in `path` (or random tensors: "dummy")."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} must be one of {list(LOAD_FORMATS)}")
    load_tensors(model, dummy_tensors(model) if load_format == "dummy" else safetensors_tensors(path), path)


def load_tensors(model: nn.Module, tensors: Iterator[tuple[str, str, torch.Tensor]], path: str):
    """Fill every parameter from (name, source, tensor) triples; `path` names the checkpoint in errors."""
    packed = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters())  # tied weights appear once, under their first name
    filled: dict[str, set] = {}
    sources: dict[str, str] = {}
    for name, source, tensor in tensors:
        if name in sources:
            raise ValueError(f"checkpoint tensor {name!r} is in both {sources[name]!r} and {source!r}")
        sources[name] = source
        target = parameter_for(name, packed)
        if target is None:
            continue
        param_name, shard_id = target
        if param_name not in params:
            if name == "lm_head.weight":
                continue  # tied embeddings: some checkpoints still store the head
            raise ValueError(f"checkpoint tensor {name!r} in {source!r} matches no model parameter")
        param = params[param_name]
        weight_loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            weight_loader(param, tensor) if shard_id is None else weight_loader(param, tensor, shard_id)
        except (ValueError, RuntimeError, IndexError) as e:
            raise ValueError(f"checkpoint tensor {name!r} of shape {list(tensor.shape)} in {source!r} does not fit "
                             f"parameter {param_name!r} of shape {list(param.shape)}: {e}") from e
        filled.setdefault(param_name, set()).add(shard_id)
    missing = []
    for param_name, param in params.items():
        if param_name not in filled:
            missing.append(param_name)
        elif None not in filled[param_name] and hasattr(param, "shard_ids"):
            lacking = [s for s in param.shard_ids if s not in filled[param_name]]
            if lacking:
                missing.append(f"{param_name} (parts {lacking[:4]}{' ...' if len(lacking) > 4 else ''})")
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
