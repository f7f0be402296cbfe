"""`deepspeed.runtime.dataloader`: `RepeatingLoader` and `DeepSpeedDataLoader`, in DeepSpeed's order."""

from __future__ import annotations

from typing import Any, Callable

from trident.data.repeating_loader import RepeatingLoader
from trident.deepspeed.engine.loader import deepspeed_loader

__all__ = ["RepeatingLoader", "DeepSpeedDataLoader"]


def DeepSpeedDataLoader(dataset: Any, batch_size: int, pin_memory: bool = False, local_rank: int = 0,  # noqa: N802
                        tput_timer: Any = None, collate_fn: Callable | None = None,
                        num_local_io_workers: int | None = None, data_sampler: Any = None,
                        data_parallel_world_size: int | None = None, data_parallel_rank: int | None = None,
                        dataloader_drop_last: bool = False, deepspeed_dataloader_config: dict | None = None):
    """DeepSpeed's loader class, as a function: torch's DistributedSampler (seed 0) over the
    data-parallel ranks, micro-batches of `batch_size`. Curriculum learning is not available."""
    if (deepspeed_dataloader_config or {}).get("curriculum_learning"):
        raise ValueError("DeepSpeedDataLoader: curriculum learning (deepspeed_dataloader_config) is a DeepSpeed "
                         "feature trident does not implement; drop it")
    import torch.distributed as dist
    replicas = data_parallel_world_size or (dist.get_world_size() if dist.is_initialized() else 1)
    rank = data_parallel_rank if data_parallel_rank is not None else (dist.get_rank() if dist.is_initialized() else 0)
    return deepspeed_loader(dataset, batch_size, replicas, rank, drop_last=dataloader_drop_last, collate_fn=collate_fn,
                            data_sampler=data_sampler, num_workers=num_local_io_workers or 0, pin_memory=pin_memory)
