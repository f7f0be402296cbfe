"""The server role as functions, and the public entry of a parameter-server run.

`serve` runs this rank's server until every worker has finished and returns (for tests and for
programs that do something after serving); `serve_shard` is the same loop for a layout already
agreed, which the run assembly (`trident.engine.parameter_server_run`) calls on server ranks.
A server's shard holds fp32 copies of its parameters, the configured optimizer over them
(`shard_optimizer`) and the lr schedule (`shard_schedule`).

`initialize_parameter_server` is what `trident.initialize` runs when `parameter_server.servers`
> 0. The run is assembled by the engine, which sits above this package: `trident.engine`
registers its assembly here when imported (as `import trident` does), so this package keeps the
name without importing the engine.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable

import torch

from trident.config import TridentConfig, load_config
from trident.monitor.log import logger
from trident.optim.factory import build_optimizer
from trident.optim.schedulers import build_scheduler
from trident.parameter_server.layout import ParamGroups, PSLayout, build_layout
from trident.parameter_server.protocol import format_updates
from trident.parameter_server.server import ParameterServer, ServeResult
from trident.parameter_server.shard import ShardState

_run_assembly: Callable | None = None


def register_run_assembly(assemble: Callable) -> None:
    """Called by `trident.engine.parameter_server_run` when imported: the function that builds a
    parameter-server run (servers serve, workers get their Engine)."""
    global _run_assembly
    _run_assembly = assemble


def initialize_parameter_server(cfg: TridentConfig, model: torch.nn.Module, optimizer: Any = None,
                                model_parameters: Iterable | None = None, training_data: Any = None,
                                lr_scheduler: Any = None, collate_fn: Callable | None = None, mesh: Any = None):
    """Workers: (Engine, optimizer view, data loader, lr schedule view). Servers serve until every
    worker has finished, then the process exits 0 (on failure the error propagates: exit 1)."""
    if _run_assembly is None:
        raise RuntimeError("no parameter-server run assembly is registered: `import trident` (which imports "
                           "trident.engine) before starting a parameter-server run")
    return _run_assembly(cfg, model, optimizer=optimizer, model_parameters=model_parameters,
                         training_data=training_data, lr_scheduler=lr_scheduler, collate_fn=collate_fn, mesh=mesh)


def serve(config: str | dict | TridentConfig, model: torch.nn.Module, optimizer: Any = None,
          model_parameters: Iterable | None = None, lr_scheduler: Any = None, mesh: Any = None) -> ServeResult:
    """Run this rank's server until every worker has finished; returns its shard, update records
    and statistics. Call it on the server ranks where the workers call `trident.initialize`."""
    cfg = load_config(config)
    if cfg.parameter_server.servers < 1:
        raise ValueError("serve() needs parameter_server.servers >= 1 in the config, got "
                         f"{cfg.parameter_server.servers}")
    layout = build_layout(cfg, model, optimizer, model_parameters, mesh)
    if not layout.is_server:
        raise ValueError(f"serve() was called on global rank {layout.rank}, a worker (the first "
                         f"{layout.servers} ranks serve: {layout.server_ranks}); call trident.initialize there")
    return serve_shard(cfg, layout, model, optimizer, lr_scheduler)


def serve_shard(cfg: TridentConfig, layout: PSLayout, model: torch.nn.Module, optimizer: Any,
                lr_scheduler: Any) -> ServeResult:
    """Build this server's shard of `layout` and serve it until every worker has finished."""
    shard_layout = layout.shards[layout.server_index]
    named = dict(model.named_parameters())
    names = [layout.names[i] for i in shard_layout.tensors]
    shard = ShardState(shard_layout, names, [named[n].detach().float() for n in names],
                       lambda by_name: shard_optimizer(cfg, optimizer, layout.param_groups, by_name),
                       lambda opt: shard_schedule(cfg, lr_scheduler, opt))
    ps = cfg.parameter_server
    if layout.server_index == 0:
        logger.info("parameter servers: %d server(s) + %d worker(s), mode %s%s, placement %s\n%s", layout.servers,
                    layout.workers, ps.mode, f" (staleness {ps.staleness})" if ps.mode == "async" else "",
                    ps.placement, layout.describe())
    result = ParameterServer(layout, shard, ps.mode, cfg.gradient_clipping).serve()
    if layout.server_index == 0:
        logger.info("parameter server 0 done: version %d, clock %d, steps per worker %s%s\n%s", result.version,
                    result.clock, result.worker_steps, f", lost {list(result.lost.values())}" if result.lost else "",
                    format_updates(result.records, limit=0))
    return result


def shard_optimizer(cfg: TridentConfig, optimizer: Any, groups: ParamGroups,
                    params: dict[str, torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The user's optimizer, over this shard: the same groups (empty where the shard has none of
    a group's parameters, so group i is group i on every server) and hyper-parameters."""
    shard_groups = [{**hp, "params": [params[n] for n in names if n in params]} for hp, names in groups]
    if isinstance(optimizer, torch.optim.Optimizer):
        cls = type(optimizer)
        accepted = inspect.signature(cls.__init__).parameters
        return cls(shard_groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})
    if callable(optimizer):
        return optimizer(shard_groups)
    if optimizer is not None:
        raise TypeError(f"optimizer= must be a torch.optim.Optimizer or a callable, got {type(optimizer).__name__}")
    return build_optimizer(cfg.optimizer, shard_groups)


def shard_schedule(cfg: TridentConfig, lr_scheduler: Any, optimizer: torch.optim.Optimizer):
    if lr_scheduler is None:
        return build_scheduler(cfg.scheduler, optimizer)
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        return lr_scheduler(optimizer)
    raise TypeError("lr_scheduler= under parameter_server must be a callable taking the optimizer (each server "
                    f"builds its own schedule over its shard), got a {type(lr_scheduler).__name__} instance; pass "
                    "e.g. lambda opt: MySchedule(opt), or use the config's `scheduler` section")
