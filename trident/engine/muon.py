"""Muon in the engine: which parameters it steps, and the layouts it runs under so far.

The config's `optimizer: {type: "Muon"}` names its AdamW exceptions by module name
(`params.exclude`), so the engine tags the model's parameters (`use_muon`, as DeepSpeed's
engine does) before the optimizer is built, and carries the tags to fp32 master copies.

Newton-Schulz needs each matrix whole. Data parallelism (ZeRO stage 0) and pipeline stages
hold whole matrices, so Muon runs there unchanged; under ZeRO 1-3 trident.zero.muon gathers
each matrix's momentum-updated gradient, orthogonalizes it on an owner rank and scatters the
shards back. Offloaded optimizer states and tensor-parallel shards are refused with a clear
error until that step covers them.
"""

from __future__ import annotations

import torch

from trident.config.errors import ConfigError, ConfigIssue
from trident.optim.muon import DEFAULT_EXCLUDE, Muon, flag_muon_params


def is_muon_config(cfg) -> bool:
    return cfg.optimizer is not None and cfg.optimizer.type.lower() == "muon"


def flag_model(cfg, model: torch.nn.Module) -> None:
    """Tag the model's parameters for a config-built Muon (names decide the exceptions)."""
    if is_muon_config(cfg):
        flag_muon_params(model, cfg.optimizer.params.get("exclude", DEFAULT_EXCLUDE))


def carry_flags(mapping: dict[int, torch.Tensor], params: list[torch.Tensor]) -> None:
    """Give each master copy its parameter's `use_muon` tag."""
    for p in params:
        master = mapping.get(id(p))
        if master is not None and master is not p and hasattr(p, "use_muon"):
            master.use_muon = p.use_muon


def check_muon_layout(optimizer: torch.optim.Optimizer, offload: str, tp_size: int) -> None:
    """A clear error where Muon would see only pieces of its matrices."""
    if not isinstance(optimizer, Muon):
        return
    if offload != "none":
        raise ConfigError([ConfigIssue("zero_optimization.offload_optimizer.device", (
            f"Muon does not run with offloaded optimizer states in this version, got {offload!r}: its "
            "distributed step gathers whole matrices on the device. Set offload_optimizer.device to none, "
            "or use AdamW with offload"))])
    sharded = [p for g in optimizer.param_groups if g["use_muon"] for p in g["params"]
               if getattr(p, "tensor_model_parallel", False)]
    if tp_size > 1 and sharded:
        raise ConfigError([ConfigIssue("tensor_parallel.size", (
            f"Muon does not run on tensor-parallel shards in this version, got size {tp_size} with "
            f"{len(sharded)} sharded matrices: Newton-Schulz needs each matrix whole. Set tensor_parallel.size "
            "to 1, or use AdamW"))])
