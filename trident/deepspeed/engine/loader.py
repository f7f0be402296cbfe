"""The data loaders DeepSpeed's engines build, with DeepSpeed's order (layer 8, below the
engine's assembly, which builds `initialize(training_data=...)`'s loader with it).

DeepSpeed 0.19 (`DeepSpeedEngine.deepspeed_io`, `DeepSpeedDataLoader`): torch's
`DistributedSampler` over the data-parallel ranks, shuffled with its default seed 0 for
training and in order for evaluation, `dataloader_drop_last` from the config, micro-batches of
`train_micro_batch_size_per_gpu`; no `set_epoch` is ever called, so every pass repeats epoch
0's order. The pipeline engine's loader is not shuffled and repeats forever. trident's
`DistributedSampler` draws torch's permutation, so the batches are DeepSpeed's, and it also
records its position for checkpoints.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from trident.data.repeating_loader import RepeatingLoader
from trident.data.sampler import DistributedSampler

DEEPSPEED_DATA_SEED = 0
"""The seed of DeepSpeed's training sampler (torch's DistributedSampler default)."""


def deepspeed_loader(dataset: Any, micro_batch: int, replicas: int, rank: int, shuffle: bool = True,
                     drop_last: bool = False, collate_fn: Callable | None = None, data_sampler: Any = None,
                     seed: int = DEEPSPEED_DATA_SEED, num_workers: int = 0,
                     pin_memory: bool = False) -> torch.utils.data.DataLoader:
    """Micro-batches of this rank's share of `dataset`, in DeepSpeed's order."""
    sampler = data_sampler if data_sampler is not None else DistributedSampler(
        dataset, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed)
    return torch.utils.data.DataLoader(dataset, batch_size=micro_batch, sampler=sampler, collate_fn=collate_fn,
                                       drop_last=drop_last, num_workers=num_workers,
                                       pin_memory=pin_memory and torch.cuda.is_available())


def pipeline_loader(dataset: Any, micro_batch: int, replicas: int, rank: int, drop_last: bool = False,
                    collate_fn: Callable | None = None) -> RepeatingLoader:
    """The pipeline engine's loader: in order (no shuffle), repeated forever (DeepSpeed's
    `PipelineEngine._build_data_iter`)."""
    return RepeatingLoader(deepspeed_loader(dataset, micro_batch, replicas, rank, shuffle=False,
                                            drop_last=drop_last, collate_fn=collate_fn))
