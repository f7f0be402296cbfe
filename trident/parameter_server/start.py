"""Start-up of both roles: `initialize_parameter_server` (what `trident.initialize` hands over to
when `parameter_server.servers` > 0) and `serve` (the server loop as a function that returns).

The order: parse the config; start torch.distributed and agree the roles, placement and session
(`layout`); then a server builds its shard (fp32 copies of its parameters, the configured
optimizer and lr schedule over them) and serves, while a worker resolves the batch triangle
over the workers, casts the model to the compute dtype, builds its buffers and pulls the servers'
parameters (`PushPullStrategy`), and gets the one `Engine` over that strategy, with read-only
views of the servers' optimizer and schedule, and a data loader sharded over the workers.
"""

from __future__ import annotations

import inspect
import logging
import sys
from typing import Any, Callable, Iterable

import torch

from trident.config import TridentConfig, load_config, resolve_batch
from trident.data.sampler import DistributedSampler
from trident.engine.engine import Engine, EngineRanks
from trident.monitor.log import logger, setup_logging
from trident.monitor.writers import Monitors
from trident.optim.factory import build_optimizer
from trident.optim.schedulers import build_scheduler
from trident.parameter_server.layout import ParamGroups, PSLayout, build_layout
from trident.parameter_server.protocol import format_updates
from trident.parameter_server.remote import RemoteOptimizer, RemoteSchedule
from trident.parameter_server.server import ParameterServer, ServeResult
from trident.parameter_server.shard import ShardState
from trident.parameter_server.strategy import PushPullStrategy
from trident.precision.loss_scaler import make_loss_scaler
from trident.precision.mixed import compute_dtype


def initialize_parameter_server(cfg: TridentConfig, model: torch.nn.Module, optimizer: Any = None,
                                model_parameters: Iterable | None = None, training_data: Any = None,
                                lr_scheduler: Any = None, collate_fn: Callable | None = None, mesh: Any = None):
    """Workers: (Engine, optimizer view, data loader, lr schedule view). Servers serve until every
    worker has finished, then the process exits 0 (on failure the error propagates: exit 1)."""
    layout = build_layout(cfg, model, optimizer, model_parameters, mesh)
    setup_logging(layout.rank)
    if layout.is_server:
        _serve(cfg, layout, model, optimizer, lr_scheduler)
        sys.exit(0)
    return _start_worker(cfg, layout, model, training_data, collate_fn)


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
    return _serve(cfg, layout, model, optimizer, lr_scheduler)


def _serve(cfg: TridentConfig, layout: PSLayout, model: torch.nn.Module, optimizer: Any,
           lr_scheduler: Any) -> ServeResult:
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


def _start_worker(cfg: TridentConfig, layout: PSLayout, model: torch.nn.Module, training_data: Any,
                  collate_fn: Callable | None):
    first = layout.worker_index == 0
    if first:  # worker 0 logs the step lines (global rank 0 is a server)
        logger.setLevel(logging.INFO)
    batch = resolve_batch(cfg, layout.workers)
    dtype = compute_dtype(cfg)
    model.to(dtype)
    strategy = PushPullStrategy(model, cfg, layout, dtype)
    # No mesh: dp counts the workers, which never wait for each other; no masters (the servers
    # keep fp32 shards) or comms logger (the traffic is counted by comm_bytes()). Under fp16 each
    # worker's loss scaler moves alike: every worker gets the same overflow verdict per round.
    ranks = EngineRanks(global_rank=layout.rank, world_size=len(layout.ranks), dp_rank=layout.worker_index,
                        dp_world_size=layout.workers, writer=first, group=None)
    engine = Engine(model, cfg, mesh=None, batch=batch, master=None, strategy=strategy,
                    optimizer=RemoteOptimizer(strategy), lr_scheduler=RemoteSchedule(strategy), loss_scaler=make_loss_scaler(cfg.fp16) if cfg.fp16.enabled else None,
                    comms_logger=None, monitors=Monitors(cfg.tensorboard, cfg.csv_monitor, enabled=first),
                    ranks=ranks)
    loader = None
    if training_data is not None:
        sampler = DistributedSampler(training_data, num_replicas=layout.workers, rank=layout.worker_index,
                                     shuffle=True, seed=cfg.seed)
        loader = torch.utils.data.DataLoader(training_data, batch_size=batch.micro_batch_size, sampler=sampler,
                                             collate_fn=collate_fn, drop_last=False)
    engine.training_dataloader = loader
    if first:
        logger.info("worker 0 of %d: %s", layout.workers, batch.describe(layout.workers))
    if cfg.checkpoint.auto_resume and cfg.checkpoint.path:
        _, client_state = engine.load_checkpoint(cfg.checkpoint.path)
        engine.resumed_client_state = client_state
        sampler_state = (client_state or {}).get("sampler")
        if loader is not None and sampler_state is not None:
            loader.sampler.load_state_dict(sampler_state)
    return engine, engine.optimizer, loader, engine.lr_scheduler
