"""The batch-size triangle, in one place: train_batch_size = micro x accumulation x dp.

DeepSpeed's rules: all three given must agree; any two determine the third, which must come out
whole; train_batch_size alone means no accumulation (micro = train / dp); the micro batch alone
means no accumulation (train = micro x dp); accumulation alone, or nothing, is an error.
"""

from __future__ import annotations

from dataclasses import dataclass

from trident.config.errors import ConfigError, ConfigIssue
from trident.config.schema import TridentConfig

TB, MB, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


@dataclass(frozen=True)
class BatchSizes:
    """The resolved triangle for one data-parallel size."""

    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int

    def describe(self, dp_size: int) -> str:
        """`train_batch_size 32 = micro 4 x accumulation 4 x data-parallel size 2`."""
        return (f"train_batch_size {self.train_batch_size} = micro {self.micro_batch_size} x accumulation "
                f"{self.gradient_accumulation_steps} x data-parallel size {dp_size}")


class BatchGetters:
    """DeepSpeed's batch getters for an engine that has `batch: BatchSizes` and counts
    `micro_steps` (the collective engine and the parameter-server worker share them)."""

    batch: BatchSizes
    micro_steps: int

    def train_batch_size(self) -> int:
        return self.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.batch.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.batch.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.batch.gradient_accumulation_steps == 0


def resolve_batch(cfg: TridentConfig, dp_size: int) -> BatchSizes:
    """Fill in the missing sizes for `dp_size` data-parallel ranks; contradictions raise ConfigError."""
    if not isinstance(dp_size, int) or isinstance(dp_size, bool) or dp_size < 1:
        raise ValueError(f"dp_size must be a positive integer, got {dp_size!r}")
    sizes, issues = _resolve(cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, _gas(cfg), dp_size)
    if issues:
        raise ConfigError(issues)
    return sizes


def batch_issues(cfg: TridentConfig, dp_size: int | None = None) -> list[ConfigIssue]:
    """The batch problems of a config; without `dp_size`, only those that no dp size can fix."""
    tb, mb, gas = cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, _gas(cfg)
    if dp_size is not None:
        return _resolve(tb, mb, gas, dp_size)[1]
    if tb is None and mb is None:
        return _resolve(tb, mb, gas, 1)[1]
    per_rank = (mb or 1) * (gas or 1)
    if tb is not None and tb % per_rank:
        return [ConfigIssue(TB, f"{tb} is not a multiple of {_given(mb, gas)} = {per_rank}, so no data-parallel "
                                "size fits (train_batch_size = micro x accumulation x dp); change one of them")]
    return []


def _gas(cfg: TridentConfig) -> int | None:
    """gradient_accumulation_steps, or pipeline.micro_batches when only that is given (under
    pipelining the micro-batches are the accumulation steps)."""
    if cfg.gradient_accumulation_steps is None and cfg.pipeline.micro_batches is not None:
        return cfg.pipeline.micro_batches
    return cfg.gradient_accumulation_steps


def _given(mb: int | None, gas: int | None) -> str:
    parts = [f"{MB} {mb}" if mb is not None else "", f"{GAS} {gas}" if gas is not None else ""]
    return " x ".join(p for p in parts if p)


def _resolve(tb: int | None, mb: int | None, gas: int | None, dp: int) -> tuple[BatchSizes | None, list[ConfigIssue]]:
    values = f"({TB} {_show(tb)}, {MB} {_show(mb)}, {GAS} {_show(gas)}, data-parallel size {dp})"
    if tb is None and mb is None:
        return None, [ConfigIssue(MB, f"neither {TB} nor {MB} is set {values}; set {MB} (samples per rank "
                                      f"per forward), or {TB} (samples per optimizer step over all ranks)")]
    if tb is not None and mb is not None and gas is not None:
        if tb != mb * gas * dp:
            return None, [ConfigIssue(TB, f"{tb} != {MB} {mb} x {GAS} {gas} x data-parallel size {dp} = "
                                          f"{mb * gas * dp}; change one of them (or drop {TB} and it is derived)")]
        return BatchSizes(tb, mb, gas), []
    if tb is None:
        gas = gas or 1
        return BatchSizes(mb * gas * dp, mb, gas), []
    if mb is None:
        gas = gas or 1
        if tb % (gas * dp):
            return None, [ConfigIssue(TB, f"{tb} is not divisible by {GAS} {gas} x data-parallel size {dp} = "
                                          f"{gas * dp}, so {MB} = {TB} / ({GAS} x dp) is not whole {values}; "
                                          f"make {TB} a multiple of {gas * dp} or set {MB}")]
        return BatchSizes(tb, tb // (gas * dp), gas), []
    if tb % (mb * dp):
        return None, [ConfigIssue(TB, f"{tb} is not divisible by {MB} {mb} x data-parallel size {dp} = {mb * dp}, "
                                      f"so {GAS} = {TB} / ({MB} x dp) is not whole {values}; make {TB} a "
                                      f"multiple of {mb * dp} or change {MB}")]
    return BatchSizes(tb, mb, tb // (mb * dp)), []


def _show(value: int | None) -> str:
    return "unset" if value is None else str(value)
