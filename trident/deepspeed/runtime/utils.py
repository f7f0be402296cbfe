"""`deepspeed.runtime.utils`: `set_random_seed` and `see_memory_usage`, as DeepSpeed's examples call them."""

from __future__ import annotations

import random

import numpy
import torch

from trident.monitor.log import format_bytes, logger

__all__ = ["set_random_seed", "see_memory_usage"]


def set_random_seed(seed: int) -> None:
    """Seed Python's `random`, numpy and torch (every device) with `seed`, as DeepSpeed does."""
    random.seed(seed)
    numpy.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log `message` with this process's memory use (rank 0 only; nothing unless `force`)."""
    if not force:
        return
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    from trident.deepspeed.accelerator import get_accelerator
    accel = get_accelerator()
    logger.info("%s | allocated %s, peak %s, available %s", message, format_bytes(accel.memory_allocated()),
                format_bytes(accel.max_memory_allocated()), format_bytes(accel.available_memory()))
    accel.reset_peak_memory_stats()
