"""`deepspeed.utils.log_dist` / `log_dist_once` / `logger`, and `OnDevice`, as DeepSpeed scripts use them."""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist

from trident.monitor.log import logger

__all__ = ["OnDevice", "log_dist", "log_dist_once", "logger"]

_logged_once: set[str] = set()


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log `message` (prefixed `[Rank N]`) on the ranks listed; `ranks=[-1]` means every rank.
    As DeepSpeed: before torch.distributed starts every process logs; after it, only the ranks listed."""
    should_log = not dist.is_initialized()
    ranks = ranks or []
    rank = dist.get_rank() if dist.is_initialized() else -1
    if ranks and not should_log:
        should_log = ranks[0] == -1 or rank in set(ranks)
    if should_log:
        logger.log(level, "[Rank %d] %s", rank, message)


def log_dist_once(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """`log_dist`, once per process for each message."""
    if message not in _logged_once:
        _logged_once.add(message)
        log_dist(message, ranks, level)


class OnDevice(contextlib.ContextDecorator):
    """Build modules with their tensors on `device` (default "meta": no memory) and in `dtype`,
    as DeepSpeed's `OnDevice`; `enabled=False` changes nothing."""

    def __init__(self, dtype: torch.dtype | None = None, device: str | torch.device = "meta", enabled: bool = True):
        self.dtype, self.device, self.enabled = dtype, torch.device(device), enabled
        self._stack: contextlib.ExitStack | None = None
        self._old_dtype: torch.dtype | None = None

    def __enter__(self) -> OnDevice:
        if self.enabled:
            self._stack = contextlib.ExitStack()
            self._stack.enter_context(self.device)
            if self.dtype is not None:
                self._old_dtype = torch.get_default_dtype()
                torch.set_default_dtype(self.dtype)
        return self

    def __exit__(self, *exc) -> bool:
        if self._stack is not None:
            self._stack.close()
            self._stack = None
        if self._old_dtype is not None:
            torch.set_default_dtype(self._old_dtype)
            self._old_dtype = None
        return False
