"""`deepspeed.comm`'s names and signatures, over trident's collectives.

A DeepSpeed script calls `deepspeed.comm.all_reduce(t)` with no group (meaning every rank),
`all_gather(list_of_tensors, t)` with a list, and `get_rank()` at module level. These functions
keep those signatures and hand each call to `trident.comm.collectives` / `p2p` with the group
made explicit (`dist.group.WORLD` when none is given), so every call is timed by a comms logger
and noted by the hang detector's flight recorder like trident's own. Ranks in `src` / `dst`
are global, as in DeepSpeed.

Which comms logger: the one passed as `logger=`, else that of the `Comm` the call goes through.
Each engine has its own (`engine.comm`, bound to the engine's logger), so two engines in one
process log apart. The module-level functions go through the process's `Comm`, whose logger
`configure(...)` sets, as DeepSpeed's `deepspeed.comm.configure` does; `trident.initialize`
points it at the engine it builds (DeepSpeed does the same), so a script's bare
`deepspeed.comm.all_reduce(t)` logs with its engine's calls.

`trident.comm` re-exports these names (this module imports only `trident.comm`'s own modules).
"""

from __future__ import annotations

import functools
import os
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist

import trident.comm.collectives as collectives
import trident.comm.p2p as p2p
from trident.comm.backend import DistEnv
from trident.comm.backend import init_distributed as _start
from trident.comm.logger import CommsLogger

ReduceOp = dist.ReduceOp

LOGGED = ("barrier", "broadcast", "all_reduce", "inference_all_reduce", "reduce", "all_gather",
          "all_gather_into_tensor", "allgather_fn", "reduce_scatter_tensor", "reduce_scatter_fn", "all_to_all_single",
          "send", "recv", "isend", "irecv")
"""The calls that communicate, and so are timed by a comms logger."""

UNLOGGED = ("init_distributed", "is_initialized", "is_available", "get_rank", "get_world_size", "get_local_rank",
            "get_global_rank", "new_group", "get_backend", "destroy_process_group")


class Comm:
    """`deepspeed.comm` bound to one comms logger: `Comm(logger).all_reduce(t)` is
    `all_reduce(t, logger=logger)`; every other name of this module is the same function."""

    def __init__(self, logger: CommsLogger | None = None) -> None:
        self.logger = logger if logger is not None else CommsLogger(enabled=False)

    def __getattr__(self, name: str) -> Any:
        if name in LOGGED:
            return functools.partial(globals()[name], logger=self.logger)
        if name in UNLOGGED or name == "ReduceOp":
            return globals()[name]
        raise AttributeError(f"deepspeed.comm has no `{name}` in trident")

    def log_summary(self, show_straggler: bool = False) -> str:
        """Print and return the per-op summary of the calls recorded so far."""
        del show_straggler  # DeepSpeed's straggler report needs per-rank timing trident does not gather
        text = self.logger.summary() if hasattr(self.logger, "summary") else str(self.logger)
        print(text)
        return text


_process = Comm()
"""The process's `deepspeed.comm`: what the module-level functions log to."""


def configure(deepspeed_config: Any = None, enabled: bool | None = None, prof_all: bool | None = None,
              prof_ops: list[str] | None = None, verbose: bool | None = None, debug: bool | None = None,
              logger: CommsLogger | None = None) -> CommsLogger:
    """Set the process's comms logger (DeepSpeed's `deepspeed.comm.configure`); returns it."""
    if logger is not None:
        _process.logger = logger
        return logger
    settings = {}
    if deepspeed_config is not None:  # a config dict, or a parsed config (comm imports no config code)
        section = deepspeed_config.get("comms_logger", {}) if isinstance(deepspeed_config, dict) \
            else getattr(deepspeed_config, "comms_logger", None)
        settings = dict(section) if isinstance(section, dict) else (section.model_dump() if section else {})
    given = {"enabled": enabled, "prof_all": prof_all, "prof_ops": prof_ops, "verbose": verbose, "debug": debug}
    settings.update({k: v for k, v in given.items() if v is not None})
    _process.logger = CommsLogger(**settings)
    return _process.logger


def comms_logger() -> CommsLogger:
    """The logger the module-level DeepSpeed-style calls are recorded in."""
    return _process.logger


def log_summary(show_straggler: bool = False) -> str:
    """Print and return the per-op summary of the module-level calls recorded so far."""
    return _process.log_summary(show_straggler)


def _log(logger: CommsLogger | None) -> CommsLogger:
    return logger if logger is not None else _process.logger


def _g(group):
    return dist.group.WORLD if group is None else group


# -- start-up and coordinates ------------------------------------------------------------------

def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: timedelta | float | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> DistEnv:
    """Start torch.distributed as `deepspeed.init_distributed` does, from torchrun's (or
    `trident launch`'s) environment, or from a file:// / tcp:// `init_method` with `rank` /
    `world_size` (or RANK / WORLD_SIZE). `rank` / `world_size` given explicitly fill the
    environment for the rest; `distributed_port` is MASTER_PORT when none is set. With no
    launcher environment at all, a world of one process. MPI discovery is not done: start with
    torchrun or `trident launch` (`auto_mpi_discovery` is accepted and has no effect)."""
    del auto_mpi_discovery, verbose, config, dist_init_required
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else (timeout or 1800.0)
    backend = {"cpu:gloo": "gloo", "ccl": "gloo", "mpi": "gloo"}.get(dist_backend or "", dist_backend)
    if init_method not in (None, "env://"):  # file:// or tcp://, as torch.distributed takes them
        return _start(backend, timeout_s=float(seconds), init_method=init_method, rank=rank, world_size=world_size)
    if rank >= 0 and world_size > 0:
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world_size))
        os.environ.setdefault("LOCAL_RANK", str(rank))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "RANK" in os.environ:
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    return _start(backend, timeout_s=float(seconds))


def is_initialized() -> bool:
    return dist.is_initialized()


def is_available() -> bool:
    return dist.is_available()


def get_rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def get_global_rank(group=None, group_rank: int = 0) -> int:
    return dist.get_global_rank(_g(group), group_rank)


def new_group(ranks: Sequence[int] | None = None, **kwargs):
    return dist.new_group(ranks=list(ranks) if ranks is not None else None, **kwargs)


def get_backend(group=None) -> str:
    return str(dist.get_backend(group))


def destroy_process_group(group=None) -> None:
    dist.destroy_process_group(group)


# -- collectives -------------------------------------------------------------------------------

def _group_rank(group, global_rank: int) -> int:
    group = _g(group)
    return global_rank if group is dist.group.WORLD else dist.get_group_rank(group, global_rank)


def barrier(group=None, async_op: bool = False, device_ids=None, logger: CommsLogger | None = None) -> None:
    del async_op, device_ids
    collectives.barrier(group=_g(group), logger=_log(logger))


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False, logger=None, **_):
    return collectives.broadcast(tensor, _group_rank(group, src), group=_g(group), async_op=async_op,
                                 logger=_log(logger))


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False, logger=None, **_):
    return collectives.all_reduce(tensor, op, group=_g(group), async_op=async_op, logger=_log(logger))


def inference_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, logger=None):
    return all_reduce(tensor, op, group, logger=logger)


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False, logger=None, **_):
    return collectives.reduce(tensor, _group_rank(group, dst), op, group=_g(group), async_op=async_op,
                              logger=_log(logger))


def all_gather(tensor_list, tensor: torch.Tensor, group=None, async_op: bool = False, logger=None, **_):
    """DeepSpeed's (and torch's) list form; a flat output tensor works too."""
    if isinstance(tensor_list, (list, tuple)):
        return collectives.all_gather_list(tensor_list, tensor, group=_g(group), async_op=async_op,
                                           logger=_log(logger))
    return collectives.all_gather(tensor_list, tensor, group=_g(group), async_op=async_op, logger=_log(logger))


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group=None, async_op: bool = False,
                           logger=None, **_):
    return collectives.all_gather(output_tensor, tensor, group=_g(group), async_op=async_op,
                                  logger=_log(logger))


allgather_fn = all_gather_into_tensor


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op=ReduceOp.SUM, group=None,
                          async_op: bool = False, logger=None, **_):
    return collectives.reduce_scatter(output_tensor, tensor, op, group=_g(group), async_op=async_op,
                                      logger=_log(logger))


reduce_scatter_fn = reduce_scatter_tensor


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op: bool = False, logger=None, **_):
    if output_split_sizes is not None or input_split_sizes is not None:
        raise NotImplementedError("all_to_all_single with output_split_sizes / input_split_sizes is not supported "
                                  "by trident.comm; pass equal splits (no split sizes)")
    return collectives.all_to_all(output, tensor, group=_g(group), async_op=async_op, logger=_log(logger))


def send(tensor: torch.Tensor, dst: int, group=None, tag: int = 0, logger=None) -> None:
    del tag
    p2p.send(tensor, _group_rank(group, dst), group=_g(group), logger=_log(logger))


def recv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0, logger=None) -> int:
    del tag
    if src is None:
        raise ValueError("recv(src=None) (receive from any rank) is not supported by trident.comm; name the source")
    p2p.recv(tensor, _group_rank(group, src), group=_g(group), logger=_log(logger))
    return src


def isend(tensor: torch.Tensor, dst: int, group=None, tag: int = 0, logger=None):
    del tag
    return p2p.isend(tensor, _group_rank(group, dst), group=_g(group), logger=_log(logger))


def irecv(tensor: torch.Tensor, src: int, group=None, tag: int = 0, logger=None):
    del tag
    return p2p.irecv(tensor, _group_rank(group, src), group=_g(group), logger=_log(logger))
