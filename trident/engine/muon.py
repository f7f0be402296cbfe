"""Muon in the engine: which parameters it steps, and the layouts it runs under so far.

The config's `optimizer: {type: "Muon"}` names its AdamW exceptions by module name
(`params.exclude`), so the engine tags the model's parameters (`use_muon`, as DeepSpeed's
engine does) before the optimizer is built, and carries the tags to fp32 master copies.

Newton-Schulz needs each matrix whole. Data parallelism (ZeRO stage 0) and pipeline stages
hold whole matrices, so Muon runs there unchanged; under ZeRO 1-3 trident.zero.muon gathers
each matrix's momentum-updated gradient, orthogonalizes it on an owner rank and scatters the
shards back. Tensor-parallel slices are gathered whole over the tp group as well. Under
ZeRO-Offload (offload_optimizer cpu) the momentum and the step stay on the host and the
gathers and Newton-Schulz run on the model's device; NVMe-offloaded states are refused.
"""

from __future__ import annotations

import torch

from trident.config.errors import ConfigError, ConfigIssue
from trident.monitor.log import logger
from trident.optim.muon import DEFAULT_EXCLUDE, Muon, flag_muon_params


def is_muon_config(cfg) -> bool:
    return cfg.optimizer is not None and cfg.optimizer.type.lower() == "muon"


def flag_model(cfg, model: torch.nn.Module) -> None:
    """Tag the model's parameters for a config-built Muon (names decide the exceptions) and
    say in the start-up log which matrices Muon steps."""
    if not is_muon_config(cfg):
        return
    flags = flag_muon_params(model, cfg.optimizer.params.get("exclude", DEFAULT_EXCLUDE))
    muon = [n for n, f in flags.items() if f]
    matrices = [n for n, p in model.named_parameters()
                if not flags[n] and len(getattr(p, "_trident_shape", p.shape)) >= 2]
    logger.info("Muon steps %d matrices; AdamW steps the other %d parameters (matrices among them: %s)",
                len(muon), len(flags) - len(muon), ", ".join(matrices) or "none")


_CARRIED = ("use_muon", "muon_stacked", "tensor_model_parallel", "tp_spec")


def carry_flags(mapping: dict[int, torch.Tensor], params: list[torch.Tensor], optimizer=None) -> None:
    """Give each master copy of a tagged parameter its `use_muon` tag and tensor-parallel split,
    and every master its split when the user built a Muon (whose param groups may say
    `use_muon` without tagging the tensors): Muon must gather a slice whole, not orthogonalize
    it alone. Other runs keep their masters as they were."""
    user_muon = isinstance(optimizer, Muon)
    for p in params:
        master = mapping.get(id(p))
        if master is not None and master is not p and (user_muon or hasattr(p, "use_muon")):
            for attr in (a for a in _CARRIED if hasattr(p, a)):
                setattr(master, attr, getattr(p, attr))


def check_muon_layout(optimizer: torch.optim.Optimizer, offload: str, mesh) -> None:
    """Give Muon the tp group it gathers tensor-parallel slices over; a clear error where it
    would see only pieces of its matrices."""
    if not isinstance(optimizer, Muon):
        return
    if mesh.tp_size > 1:
        optimizer.tp_group = mesh.tp_group
    if offload == "nvme":
        raise ConfigError([ConfigIssue("zero_optimization.offload_optimizer.device", (
            "nvme: Muon keeps its momentum in host memory under ZeRO-Offload (device cpu) but does not swap "
            "it to NVMe in this version (each step needs every matrix's momentum at once). Set "
            "offload_optimizer.device to cpu or none"))])
