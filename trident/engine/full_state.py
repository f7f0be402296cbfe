"""Whole tensors from any layout: the one place that undoes ZeRO's partitions and tensor
parallelism's slices for everything that needs the model whole (Hugging Face and peft exports,
`trident verify`, `Engine.consolidated_state_dict`).

    full_state_dict(engine)                      # name -> whole tensor, on every rank
    whole_tensors(module, names, mesh)           # a subset, e.g. one export file at a time
    merge_tp_slices(module, local, mesh)         # this rank's slices (values, gradients) merged

ZeRO-3 parameters are gathered over their data-parallel group (`zero.GatheredParameters`, the
stored values, never int8-rounded ones); a tensor with a `tp_spec` over more than one rank is
all-gathered over the tp group and merged by its spec (fused-block strides and vocabulary
padding undone). LoRA adapters are parameters like any other, so they come whole too. Pipeline
stages hold different layers under their own names: each stage gets its own tensors whole (an
export of a pipeline goes through a checkpoint, `trident.hf.export`). Collective: every rank of
the engine calls these in the same order.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Mapping

import torch
from safetensors.torch import save_file
from torch import nn

from trident.comm import collectives
from trident.monitor.log import logger

from trident.tensor_parallel.layers import gather_whole, is_tp_split
from trident.zero.init import GatheredParameters


def _spec(t: torch.Tensor):
    spec = getattr(t, "tp_spec", None)
    return spec if spec is not None and is_tp_split(t) and spec.tp_size > 1 else None


@torch.no_grad()
def merge_tp_slices(module: nn.Module, local: Mapping[str, torch.Tensor], mesh) -> dict[str, torch.Tensor]:
    """`local` (state-dict name -> this rank's tensor, a value or a gradient) with every
    tensor-parallel slice of `module` merged whole over the tp group; others as they are."""
    state = module.state_dict(keep_vars=True)
    out = {}
    for name, t in local.items():
        spec = _spec(state[name]) if name in state else None
        if spec is not None:
            if mesh is None or mesh.tp_size != spec.tp_size:
                raise ValueError(f"{name!r} is a tensor-parallel slice over {spec.tp_size} ranks; pass the engine "
                                 "(or its mesh) so its tp ranks can merge the slices")
            t = gather_whole(t, spec, mesh.tp_group)
        out[name] = t
    return out


@torch.no_grad()
def whole_tensors(module: nn.Module, names: Iterable[str], mesh, dtype: torch.dtype | None = None,
                  merge_tp: bool = True) -> dict[str, torch.Tensor]:
    """Whole copies of `names` from `module.state_dict()`: ZeRO-3 parameters gathered over dp,
    tensor-parallel slices merged over tp (unless `merge_tp` is False: each rank keeps its
    slice), floating-point tensors cast to `dtype` when given."""
    names = list(names)
    state = module.state_dict(keep_vars=True)
    params = list({id(state[n]): state[n] for n in names if isinstance(state[n], nn.Parameter)}.values())
    with GatheredParameters(params):
        local = {n: state[n].detach().clone() for n in names}
    whole = merge_tp_slices(module, local, mesh) if merge_tp else local
    if dtype is not None:
        whole = {n: t.to(dtype) if t.is_floating_point() else t for n, t in whole.items()}
    return whole


def full_state_dict(engine, names: Iterable[str] | None = None, dtype: torch.dtype | None = None,
                    merge_tp: bool = True) -> dict[str, torch.Tensor]:
    """The engine's model state dict with every tensor whole (`whole_tensors`), on every rank."""
    module = engine.module
    return whole_tensors(module, module.state_dict().keys() if names is None else names, engine.mesh,
                         dtype=dtype, merge_tp=merge_tp)


def save_16bit_model(engine, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
    """Write the model's weights in the compute dtype to save_dir/save_filename (rank 0).

    Collective. Under ZeRO stage 3 the weights are gathered only when
    `stage3_gather_16bit_weights_on_model_save` is true; otherwise nothing is written, a
    warning says to consolidate the checkpoint instead, and False is returned (DeepSpeed's
    behaviour). A `.safetensors` name writes safetensors, anything else torch.save.
    """
    if engine.strategy.partitions_parameters and \
            not engine.config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
        logger.warning("save_16bit_model: ZeRO stage 3 keeps the weights partitioned and "
                       "zero_optimization.stage3_gather_16bit_weights_on_model_save is false, so nothing "
                       "was saved; set it to true, or save a checkpoint and run "
                       "`trident checkpoint consolidate`")
        return False
    state = engine.consolidated_state_dict()
    if engine.ranks.writer:
        path = Path(save_dir) / save_filename
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        if path.suffix == ".safetensors":
            seen, unique = set(), {}
            for k, v in engine.module.state_dict(keep_vars=True).items():
                if id(v) not in seen:
                    seen.add(id(v))
                    unique[k] = state[k].contiguous()
            save_file(unique, str(tmp))
        else:
            torch.save(state, tmp)
        os.replace(tmp, path)
    if engine.ranks.group is not None:
        collectives.barrier(group=engine.ranks.group)
    return True
