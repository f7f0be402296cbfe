"""What an export of a transformers model needs: its `config.json` and the names of its tensors.

`trident.hf` writes the folder `AutoModelForCausalLM.from_pretrained` reads; this module says
what to write about the model: `config_dict` (the config naming the model class) and
`generation_config`, and `export_record`, which a trident checkpoint's manifest keeps under
`hf` so that `trident checkpoint export-hf` can write the folder from the checkpoint alone:
the state-dict prefix of the transformers model inside a wrapper, or, for a pipeline stage
split from one, the map of every stage's names to the model's.
"""

from __future__ import annotations

import copy
import json
import sys

import torch
from torch import nn

from trident.models.transformers.detect import find_pretrained
from trident.models.transformers.meta import meta_parameters


def config_dict(hf: nn.Module, dtype: torch.dtype | None = None) -> dict:
    """The model's config as `config.json` holds it, naming the model class (`architectures`)."""
    config = json.loads(hf.config.to_json_string(use_diff=False))
    config["architectures"] = [type(hf).__name__]
    if dtype is not None:
        name = str(dtype).replace("torch.", "")
        config["dtype"] = name
        if "torch_dtype" in config:
            config["torch_dtype"] = name
    return config


def generation_config(hf: nn.Module) -> dict | None:
    """The model's generation config as `generation_config.json` holds it, or None."""
    gen = getattr(hf, "generation_config", None)
    if gen is None or not hasattr(gen, "to_json_string"):
        return None
    try:
        return json.loads(gen.to_json_string(use_diff=True))
    except Exception:  # a generation config that cannot be written is not worth failing an export for
        return None


def model_record(module: nn.Module) -> dict | None:
    """The record of the outermost PreTrainedModel inside `module`: its state-dict prefix, its
    config and its generation config; None when there is none."""
    found = find_pretrained(module)
    if found is None:
        return None
    name, hf = found
    record = {"prefix": f"{name}." if name else "", "config": config_dict(hf)}
    gen = generation_config(hf)
    if gen is not None:
        record["generation_config"] = gen
    return record


def stage_record(stage: nn.Module, split_whole) -> dict:
    """The record of a pipeline stage split from a transformers model: its config and the map of
    pipeline state-dict names to the model's, for every stage (layer indices in the names do not
    depend on the partition, so the names of a one-stage split of a meta-device copy of the model,
    `split_whole(skeleton)`, cover every stage's)."""
    config, cls_name = stage.config, stage.source_class
    names = {k: stage.source_key(k) for k in stage.state_dict(keep_vars=True) if stage.source_key(k) is not None}
    cls = getattr(sys.modules.get("transformers"), cls_name, None)
    if cls is not None:
        with meta_parameters():
            skeleton = cls(copy.deepcopy(config))
        whole = split_whole(skeleton)
        names.update({k: whole.source_key(k) for k in whole.state_dict() if whole.source_key(k) is not None})
    return {"prefix": "", "pipeline": True, "names": names,
            "config": {**json.loads(config.to_json_string(use_diff=False)), "architectures": [cls_name]}}
