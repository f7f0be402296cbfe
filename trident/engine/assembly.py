"""The steps every run assembly shares, written once.

`trident.initialize` assembles two kinds of run: collective training (engine/build.py) and a
parameter-server worker (engine/parameter_server_run.py). Both cast the model to the compute
dtype, give the one `Engine` a loss scaler and monitors, shard the training data over the ranks
that see different samples, and resume from the newest checkpoint when `checkpoint.auto_resume`
asks; only the strategy, the ranks and the optimizer differ.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from trident.checkpointing.state import resolve_tag
from trident.config import TridentConfig
from trident.deepspeed.engine.loader import DEEPSPEED_DATA_SEED, deepspeed_loader, pipeline_loader
from trident.engine.engine import Engine
from trident.engine.pipeline_engine import PipelineEngine
from trident.engine.strategy import RemoteStrategy
from trident.monitor.log import logger
from trident.monitor.writers import Monitors
from trident.precision.loss_scaler import DynamicLossScaler, StaticLossScaler, make_loss_scaler
from trident.precision.mixed import compute_dtype


def cast_to_compute_dtype(model: torch.nn.Module, cfg: TridentConfig) -> torch.dtype:
    """Cast the model to the config's compute dtype (bf16 / fp16 / fp32) and return it."""
    dtype = compute_dtype(cfg)
    model.to(dtype)
    return dtype


def loss_scaler_for(cfg: TridentConfig) -> StaticLossScaler | DynamicLossScaler | None:
    """fp16's dynamic (or static) loss scaler; None in bf16 and fp32."""
    return make_loss_scaler(cfg.fp16) if cfg.fp16.enabled else None


def monitors_for(cfg: TridentConfig, writer: bool) -> Monitors:
    """Every configured monitor (TensorBoard, CSV, W&B, Comet, MLflow), writing on the engine's
    one writer rank only; every rank checks that their libraries are installed."""
    return Monitors.from_config(cfg, enabled=writer)


def make_loader(dataset: Any, collate_fn: Callable | None, replicas: int, rank: int, micro_batch: int,
                seed: int, drop_last: bool = False) -> torch.utils.data.DataLoader:
    """Micro-batches of `dataset`, sharded over `replicas` ranks that see different samples."""
    return deepspeed_loader(dataset, micro_batch, replicas, rank, shuffle=True, drop_last=drop_last,
                            collate_fn=collate_fn, seed=seed)


def data_seed(cfg: TridentConfig) -> int:
    """The seed of the training loader's shuffle: the config's `seed` when it sets one, else
    DeepSpeed's (0, torch's DistributedSampler default), so a DeepSpeed config gets DeepSpeed's batches."""
    return cfg.seed if "seed" in cfg.model_fields_set else DEEPSPEED_DATA_SEED


def attach_data_and_resume(engine: Engine, cfg: TridentConfig, training_data: Any, collate_fn: Callable | None,
                           replicas: int, rank: int):
    """The last steps of every run: the engine's data loader (None without `training_data`) and,
    under `checkpoint.auto_resume`, the newest checkpoint. Returns the loader."""
    loader = None
    if training_data is not None and isinstance(engine, PipelineEngine):  # in order, repeated (DeepSpeed's)
        loader = pipeline_loader(training_data, engine.batch.micro_batch_size, replicas, rank,
                                 cfg.dataloader_drop_last, collate_fn)
    elif training_data is not None:
        loader = make_loader(training_data, collate_fn, replicas, rank, engine.batch.micro_batch_size,
                             data_seed(cfg), cfg.dataloader_drop_last)
    engine.training_dataloader = loader
    if cfg.checkpoint.auto_resume and cfg.checkpoint.path:
        resume(engine, loader, cfg.checkpoint.path)
    return loader


def resume(engine: Engine, loader, path: str) -> None:
    """Load the newest complete checkpoint under `path`, if any, and put the loader's sampler
    back where it was. A parameter-server worker always asks its servers (the load is a barrier
    with them, and they know where the checkpoint is); a collective run looks for `latest` first."""
    if not isinstance(engine.strategy, RemoteStrategy) and resolve_tag(path, None) is None:
        logger.info("auto_resume: no checkpoint under %s yet; starting from step 0", path)
        return
    folder, client_state = engine.load_checkpoint(path)
    engine.resumed_client_state = client_state
    if folder is None:
        logger.info("auto_resume: no checkpoint under %s yet; starting from step 0", path)
        return
    sampler_state = (client_state or {}).get("sampler")
    if loader is not None and sampler_state is not None:
        loader.sampler.load_state_dict(sampler_state)
    logger.info("auto_resume: continuing from step %d of %s", engine.global_steps, path)
