"""Load safetensors checkpoints into a model through each parameter's `weight_loader`."""
import glob
import os

import torch
from safetensors import safe_open
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor):
    param.data.copy_(loaded_weight)


def load_model(model: nn.Module, path: str):
    """Copy every tensor of the checkpoint into its parameter; a missing or unknown tensor is an error."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path!r}")
    packed = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters())  # tied weights appear once, under their first name
    loaded = set()
    for file in files:
        with safe_open(file, "pt", "cpu") as f:
            for name in f.keys():
                target, shard = name, None
                for checkpoint_name, (param_name, shard_id) in packed.items():
                    if f".{checkpoint_name}." in name:
                        target, shard = name.replace(checkpoint_name, param_name), shard_id
                        break
                if target not in params:
                    if name == "lm_head.weight" and "lm_head.weight" not in params:
                        continue  # tied embeddings: some checkpoints still store the head
                    raise ValueError(f"checkpoint tensor {name!r} in {file!r} matches no model parameter")
                param = params[target]
                weight_loader = getattr(param, "weight_loader", default_weight_loader)
                if shard is None:
                    weight_loader(param, f.get_tensor(name))
                else:
                    weight_loader(param, f.get_tensor(name), shard)
                loaded.add(target)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
