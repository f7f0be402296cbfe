"""Who serves, who works, and what each server holds: the start-up both roles share.

Every rank of the job runs the same start-up from the same model and config: the first S ranks
of the group (the world, or the mesh a test passes) serve, the other N - S work. Each rank
computes the placement and the shard layouts itself (they are pure functions of the parameter
names and shapes), and one broadcast from rank 0 agrees on the session number that keeps this
run's messages apart from any other run's in the same process group.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist

from trident.comm import collectives
from trident.comm.backend import init_distributed
from trident.config import TridentConfig
from trident.parallel.mesh import ParallelMesh
from trident.parameter_server.protocol import Tags
from trident.parameter_server.sharding import (ShardLayout, assign_servers, describe_placement, fingerprint,
                                               shard_layouts)

ParamGroups = list[tuple[dict, list[str]]]  # (hyper-parameters, parameter names) per optimizer group


@dataclass
class PSLayout:
    """The job's roles, this rank's place in them, and every shard's layout."""

    group: dist.ProcessGroup
    ranks: list[int]            # global ranks of the group, in group order; the first `servers` serve
    servers: int
    rank: int                   # this process's global rank
    tags: Tags
    names: list[str]            # trainable parameters in model order
    shapes: list[torch.Size]
    owner: list[int]            # server of each parameter
    shards: list[ShardLayout]
    fingerprint: int
    param_groups: ParamGroups
    timeout_s: float

    @property
    def server_ranks(self) -> list[int]:
        return self.ranks[:self.servers]

    @property
    def worker_ranks(self) -> list[int]:
        return self.ranks[self.servers:]

    @property
    def workers(self) -> int:
        return len(self.ranks) - self.servers

    @property
    def is_server(self) -> bool:
        return self.rank in self.server_ranks

    @property
    def server_index(self) -> int:
        return self.server_ranks.index(self.rank)

    @property
    def worker_index(self) -> int:
        return self.worker_ranks.index(self.rank)

    def describe(self) -> str:
        return describe_placement(self.names, [s.numel() for s in self.shapes], self.owner, self.servers)


def check_supported(cfg: TridentConfig) -> None:
    """Refuse combinations parameter servers do not implement, naming the key to change."""
    ps = cfg.parameter_server
    problems = []
    if cfg.fp16.enabled and ps.mode == "async":
        problems.append("fp16.enabled is true with parameter_server.mode \"async\": each worker's update is "
                        "applied on its own, so an fp16 overflow cannot be skipped by every worker alike; use "
                        "bf16, or mode \"sync\" (where the servers skip an overflowing step for all workers)")
    if cfg.zero_optimization.stage != 0:
        problems.append(f"zero_optimization.stage is {cfg.zero_optimization.stage}: servers already shard the "
                        "parameters and optimizer state; set the stage to 0")
    if cfg.pipeline.stages != 1 or cfg.tensor_parallel.size != 1:
        problems.append(f"pipeline.stages = {cfg.pipeline.stages}, tensor_parallel.size = "
                        f"{cfg.tensor_parallel.size}: workers hold the whole model; set both to 1")
    if ps.mode == "sync" and ps.staleness != 0:
        problems.append(f"parameter_server.staleness = {ps.staleness} only applies to mode \"async\"; remove it "
                        "or set mode to \"async\"")
    if problems:
        raise ValueError("parameter_server (servers = %d) cannot run this config:\n  - %s"
                         % (ps.servers, "\n  - ".join(problems)))


def param_groups(model: torch.nn.Module, optimizer: Any, model_parameters: Iterable | None) -> ParamGroups:
    """The optimizer's parameter groups by name, from an optimizer, `model_parameters`, or the model."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("the model has no parameters with requires_grad=True: nothing to train")
    names = {id(p): n for n, p in trainable}
    if isinstance(optimizer, torch.optim.Optimizer):
        raw = optimizer.param_groups
    elif model_parameters is not None:
        items = list(model_parameters)
        raw = items if items and isinstance(items[0], dict) else [{"params": items}]
    else:
        return [({}, [n for n, _ in trainable])]
    groups: ParamGroups = []
    for g in raw:
        params = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        unknown = [p for p in params if id(p) not in names]
        if unknown:
            raise ValueError(f"an optimizer parameter group holds a tensor of shape {tuple(unknown[0].shape)} that "
                             "is not a trainable parameter of the model; build the optimizer (or "
                             "model_parameters) from model.parameters()")
        groups.append(({k: v for k, v in g.items() if k != "params"}, [names[id(p)] for p in params]))
    covered = {n for _, ns in groups for n in ns}
    left = [n for n, _ in trainable if n not in covered]
    if left:
        raise ValueError(f"parameter {left[0]!r} requires grad but is in no optimizer parameter group "
                         f"({len(left)} such); add it to a group or set requires_grad=False")
    return groups


def build_layout(cfg: TridentConfig, model: torch.nn.Module, optimizer: Any, model_parameters: Iterable | None,
                 mesh: Any = None) -> PSLayout:
    """Roles, placement and session for this run. Collective over the group (one broadcast)."""
    check_supported(cfg)
    if mesh is None:
        env = init_distributed(timeout_s=cfg.distributed.timeout_s)
        mesh = ParallelMesh.build(device_type=env.device.type)  # every rank on dp: roles come below
    # the shards live in host memory: their traffic goes over gloo even when the job's default
    # backend is NCCL
    group, ranks = mesh.host_group(), list(mesh.ranks)
    servers = cfg.parameter_server.servers
    if len(ranks) <= servers:
        raise ValueError(f"parameter_server.servers = {servers} needs at least {servers + 1} processes (servers "
                         f"plus one worker), but the job has {len(ranks)}; start more processes (trident launch "
                         f"--nproc {servers + 1} or more) or lower parameter_server.servers")
    groups = param_groups(model, optimizer, model_parameters)
    in_group = {n for _, ns in groups for n in ns}
    named = [(n, p) for n, p in model.named_parameters() if n in in_group]
    names, shapes = [n for n, _ in named], [p.shape for _, p in named]
    owner = assign_servers([s.numel() for s in shapes], servers, cfg.parameter_server.placement)
    bucket = cfg.zero_optimization.reduce_bucket_size
    session = torch.tensor([secrets.randbelow(2 ** 27 - 1) + 1], dtype=torch.int64)
    collectives.broadcast(session, src=0, group=group)
    return PSLayout(group=group, ranks=ranks, servers=servers, rank=dist.get_rank(), tags=Tags(int(session)),
                    names=names, shapes=shapes, owner=owner, shards=shard_layouts(shapes, owner, servers, bucket),
                    fingerprint=fingerprint(names, shapes, owner, bucket), param_groups=groups,
                    timeout_s=cfg.distributed.timeout_s)
