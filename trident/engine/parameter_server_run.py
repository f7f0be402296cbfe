"""The parameter-server run: what `trident.initialize` assembles when `parameter_server.servers` > 0.

The order: the config is parsed (by `initialize`); torch.distributed starts and the ranks agree
the roles, placement and session (`trident.parameter_server.layout`); then a server builds its
shard and serves (`trident.parameter_server.start.serve_shard`) and the process exits 0, while a
worker resolves the batch triangle over the workers, casts the model to the compute dtype,
builds its buffers and pulls the servers' parameters (`PushPullStrategy`), and gets the one
`Engine` over that strategy, with read-only views of the servers' optimizer and schedule. The
steps a collective run shares (loss scaler, monitors, the data loader, auto-resume) are
`trident.engine.assembly`'s.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable, Iterable

import torch

from trident.config import TridentConfig, resolve_batch
from trident.engine.assembly import attach_data_and_resume, cast_to_compute_dtype, loss_scaler_for, monitors_for
from trident.engine.engine import Engine, EngineRanks
from trident.monitor.log import logger, setup_logging
from trident.parameter_server.layout import PSLayout, build_layout
from trident.parameter_server.remote import RemoteOptimizer, RemoteSchedule
from trident.parameter_server.start import register_run_assembly, serve_shard
from trident.parameter_server.strategy import PushPullStrategy


def initialize_parameter_server(cfg: TridentConfig, model: torch.nn.Module, optimizer: Any = None,
                                model_parameters: Iterable | None = None, training_data: Any = None,
                                lr_scheduler: Any = None, collate_fn: Callable | None = None, mesh: Any = None):
    """Workers: (Engine, optimizer view, data loader, lr schedule view). Servers serve until every
    worker has finished, then the process exits 0 (on failure the error propagates: exit 1)."""
    layout = build_layout(cfg, model, optimizer, model_parameters, mesh)
    setup_logging(layout.rank)
    if layout.is_server:
        serve_shard(cfg, layout, model, optimizer, lr_scheduler)
        sys.exit(0)
    return _start_worker(cfg, layout, model, training_data, collate_fn)


def _start_worker(cfg: TridentConfig, layout: PSLayout, model: torch.nn.Module, training_data: Any,
                  collate_fn: Callable | None):
    first = layout.worker_index == 0
    if first:  # worker 0 logs the step lines (global rank 0 is a server)
        logger.setLevel(logging.INFO)
    batch = resolve_batch(cfg, layout.workers)
    dtype = cast_to_compute_dtype(model, cfg)
    strategy = PushPullStrategy(model, cfg, layout, dtype)
    # No mesh: dp counts the workers, which never wait for each other; no masters (the servers
    # keep fp32 shards) or comms logger (the traffic is counted by comm_bytes()). Under fp16 each
    # worker's loss scaler moves alike: every worker gets the same overflow verdict per round.
    ranks = EngineRanks(global_rank=layout.rank, world_size=len(layout.ranks), dp_rank=layout.worker_index,
                        dp_world_size=layout.workers, writer=first, group=None)
    engine = Engine(model, cfg, mesh=None, batch=batch, master=None, strategy=strategy,
                    optimizer=RemoteOptimizer(strategy), lr_scheduler=RemoteSchedule(strategy),
                    loss_scaler=loss_scaler_for(cfg), comms_logger=None, monitors=monitors_for(cfg, first),
                    ranks=ranks)
    if first:
        logger.info("worker 0 of %d: %s", layout.workers, batch.describe(layout.workers))
    loader = attach_data_and_resume(engine, cfg, training_data, collate_fn, layout.workers, layout.worker_index)
    return engine, engine.optimizer, loader, engine.lr_scheduler


register_run_assembly(initialize_parameter_server)
