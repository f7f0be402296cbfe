"""Optimizers and learning-rate schedules built from a config's `optimizer` and `scheduler` sections."""

from trident.optim.cpu_adam import CPUAdam
from trident.optim.muon import Muon
from trident.optim.factory import Lion, build_optimizer, check_optimizer, resolve_optimizer_config
from trident.optim.schedulers import (LRRangeTest, LRSchedule, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR,
                                      build_scheduler, check_scheduler, resolve_scheduler_config)

__all__ = [
    "CPUAdam", "Lion", "Muon", "build_optimizer", "check_optimizer", "resolve_optimizer_config",
    "LRSchedule", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest",
    "build_scheduler", "check_scheduler", "resolve_scheduler_config",
]
