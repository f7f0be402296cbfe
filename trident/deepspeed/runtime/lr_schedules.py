"""`deepspeed.runtime.lr_schedules`: DeepSpeed's learning-rate schedulers (trident.optim's)."""

from __future__ import annotations

import argparse

from trident.optim.schedulers import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

VALID_LR_SCHEDULES = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]

__all__ = ["LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "VALID_LR_SCHEDULES",
           "add_tuning_arguments"]


def add_tuning_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's convergence-tuning arguments (`--lr_schedule`, `--warmup_*`...) on `parser`;
    a script passes them on to its scheduler itself."""
    group = parser.add_argument_group("Convergence Tuning", "Convergence tuning configurations")
    group.add_argument("--lr_schedule", type=str, default=None, help="LR schedule for training.")
    group.add_argument("--lr_range_test_min_lr", type=float, default=0.001, help="Starting lr value.")
    group.add_argument("--lr_range_test_step_rate", type=float, default=1.0, help="scaling rate for LR range test.")
    group.add_argument("--lr_range_test_step_size", type=int, default=1000, help="training steps per LR change.")
    group.add_argument("--lr_range_test_staircase", type=bool, default=False, help="use staircase scaling.")
    group.add_argument("--warmup_min_lr", type=float, default=0, help="WarmupLR minimum/initial LR value")
    group.add_argument("--warmup_max_lr", type=float, default=0.001, help="WarmupLR maximum LR value.")
    group.add_argument("--warmup_num_steps", type=int, default=1000, help="WarmupLR step count for LR warmup.")
    group.add_argument("--warmup_type", type=str, default="log", help="WarmupLR increasing function during warmup")
    return parser
