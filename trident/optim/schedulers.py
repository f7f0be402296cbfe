"""DeepSpeed's learning-rate schedules: same names, parameters, defaults and formulas.

A schedule counts optimizer steps in `last_batch_iteration` (-1 before the first `step()`) and
sets the lr of every param group of the optimizer it wraps. `step()` is called after each
optimizer step, so optimizer step k+1 runs with `lr_at(k)`. `lr_at(k)` is a pure function of k,
which is what the tests check and what makes a resumed run exact: the state is just k.

Per-group values: any lr-like parameter may be one number or a list with one value per param group.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field

from trident.config.errors import ConfigError, ConfigIssue, describe_value, unknown_name_message
from trident.config.loader import register_section_rules, validate_section
from trident.config.schema import SchedulerConfig, Section
from trident.monitor.log import logger

PerGroup = float | list[float]


def _last() -> Any:
    return Field(-1, ge=-1, description="Steps already taken (-1 = none); DeepSpeed's resume argument.")


def _warmup_type() -> Any:
    return Field("log", description="Shape of the warmup: log (fast start) or linear.")


def _warmup_steps() -> Any:
    return Field(1000, gt=0, description="Steps of warmup (at least 2 are used, as in DeepSpeed).")



class WarmupLRParams(Section):
    """WarmupLR: min -> max lr over warmup_num_steps, then constant."""

    warmup_min_lr: PerGroup = Field(0.0, description="lr at the start of warmup.")
    warmup_max_lr: PerGroup | None = Field(None, description="lr after warmup; null = the optimizer's lr.")
    warmup_num_steps: int = _warmup_steps()
    warmup_type: Literal["log", "linear"] = _warmup_type()
    last_batch_iteration: int = _last()


class WarmupDecayLRParams(Section):
    """WarmupDecayLR: WarmupLR, then linear decay to 0 at total_num_steps."""

    total_num_steps: int = Field(gt=0, description="Step at which the lr reaches 0.")
    warmup_min_lr: PerGroup = Field(0.0, description="lr at the start of warmup.")
    warmup_max_lr: PerGroup = Field(0.001, description="lr after warmup (DeepSpeed's default 0.001).")
    warmup_num_steps: int = _warmup_steps()
    warmup_type: Literal["log", "linear"] = _warmup_type()
    last_batch_iteration: int = _last()


class WarmupCosineLRParams(Section):
    """WarmupCosineLR: ratios of the optimizer's lr; warmup, then cosine decay."""

    total_num_steps: int = Field(gt=0, description="Step at which the cosine reaches cos_min_ratio.")
    warmup_min_ratio: float = Field(0.0, ge=0, le=1, description="Ratio of the optimizer's lr at warmup start.")
    warmup_num_steps: int = _warmup_steps()
    cos_min_ratio: float = Field(0.0001, ge=0, le=1, description="Ratio of the optimizer's lr at the end.")
    warmup_type: Literal["log", "linear"] = _warmup_type()
    last_batch_iteration: int = _last()


class OneCycleParams(Section):
    """OneCycle (1cycle policy): lr up then down over one cycle, then optional decay."""

    cycle_min_lr: PerGroup = Field(description="lr at the cycle's ends.")
    cycle_max_lr: PerGroup = Field(description="lr at the cycle's peak.")
    decay_lr_rate: float = Field(0.0, ge=0, description="After the cycle: lr = min / (1 + rate * intervals).")
    cycle_first_step_size: int = Field(2000, gt=0, description="Steps of the rising half.")
    cycle_second_step_size: int | None = Field(None, ge=0, description="Steps of the falling half; null = first.")
    cycle_first_stair_count: int = Field(0, ge=0, description="Stairs in the rising half; 0 = smooth.")
    cycle_second_stair_count: int | None = Field(None, ge=0, description="Stairs in the falling half; null = first.")
    decay_step_size: int = Field(0, ge=0, description=(
        "Steps per decay interval after the cycle (intervals = steps since the cycle / this); 0 = no decay."))
    cycle_momentum: bool = Field(True, description="Cycle momentum (Adam's beta1, SGD's momentum) inversely to lr.")
    cycle_min_mom: PerGroup = Field(0.8, description="Momentum at the lr peak.")
    cycle_max_mom: PerGroup = Field(0.9, description="Momentum at the cycle's ends.")
    decay_mom_rate: float = Field(0.0, ge=0, description="After the cycle: mom = max * (1 + rate * intervals).")
    last_batch_iteration: int = _last()


class LRRangeTestParams(Section):
    """LRRangeTest: lr grows from a minimum to find the largest lr that still trains."""

    lr_range_test_min_lr: PerGroup = Field(1e-3, description="Starting lr.")
    lr_range_test_step_size: int = Field(2000, gt=0, description="Steps per increase interval.")
    lr_range_test_step_rate: float = Field(1.0, ge=0, description="lr = min * (1 + rate * intervals).")
    lr_range_test_staircase: bool = Field(False, description="Whole intervals only (a staircase).")
    last_batch_iteration: int = _last()


class LRSchedule:
    """Shared mechanics: the step counter, applying lrs to the optimizer, state dicts."""

    Params: ClassVar[type[Section]]

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int = -1) -> None:
        self.optimizer = optimizer
        self.base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        self.last_batch_iteration = last_batch_iteration

    def lr_at(self, step: int) -> list[float]:
        """The lr of every param group after `step()` has been called step + 1 times."""
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        return self.lr_at(self.last_batch_iteration)

    def get_last_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one step (or jump to `last_batch_iteration`) and set the optimizer's lrs."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply()

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.last_batch_iteration = int(state["last_batch_iteration"])
        self._apply()

    def _apply(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr

    def _per_group(self, value: Any, name: str) -> list[float]:
        n = len(self.optimizer.param_groups)
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise ConfigError([ConfigIssue(f"scheduler.params.{name}", (
                    f"has {len(value)} values but the optimizer has {n} param groups; give one number or {n}"))])
            return [float(v) for v in value]
        return [float(value)] * n


def _warmup_fraction(step: int, num_steps: int, warmup_type: str) -> float:
    """Progress through warmup in [0, 1): log(step + 1) / log(N), or step / N."""
    if warmup_type == "log":
        return math.log(step + 1) / math.log(num_steps)
    return step / num_steps


class WarmupLR(LRSchedule):
    """lr = min + (max - min) * warmup_fraction(step) during warmup, then max."""

    Params = WarmupLRParams

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: PerGroup = 0.0,
                 warmup_max_lr: PerGroup | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = self._per_group(warmup_min_lr, "warmup_min_lr")
        self.max_lrs = self.base_lrs if warmup_max_lr is None else self._per_group(warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, warmup_num_steps)  # log(1) = 0 would divide by zero
        self.warmup_type = warmup_type
        self._apply()

    def _gamma(self, step: int) -> float:
        if step < self.warmup_num_steps:
            return _warmup_fraction(step, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def lr_at(self, step: int) -> list[float]:
        if step < 0:
            return list(self.min_lrs)
        gamma = self._gamma(step)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then lr = min + (max - min) * (total - step) / (total - warmup), floored at min."""

    Params = WarmupDecayLRParams

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_lr: PerGroup = 0.0,
                 warmup_max_lr: PerGroup = 0.001, warmup_num_steps: int = 1000, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        if total_num_steps < self.warmup_num_steps:
            logger.warning("WarmupDecayLR: total_num_steps %d < warmup_num_steps %d", total_num_steps,
                           self.warmup_num_steps)

    def _gamma(self, step: int) -> float:
        if step < self.warmup_num_steps:
            return _warmup_fraction(step, self.warmup_num_steps, self.warmup_type)
        return max(0.0, (self.total_num_steps - step) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(LRSchedule):
    """lr = optimizer lr x ratio: warmup from warmup_min_ratio to 1, then a cosine to cos_min_ratio.

    Before the first step() the ratio is 0, as in DeepSpeed.
    """

    Params = WarmupCosineLRParams

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        if total_num_steps < self.warmup_num_steps:
            logger.warning("WarmupCosineLR: total_num_steps %d < warmup_num_steps %d", total_num_steps,
                           self.warmup_num_steps)
        self._apply()

    def ratio_at(self, step: int) -> float:
        """The multiplier of the optimizer's lr after step + 1 calls of step()."""
        if step < 0:
            return 0.0
        if step < self.warmup_num_steps:
            fraction = _warmup_fraction(step, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + fraction * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (step - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lr_at(self, step: int) -> list[float]:
        ratio = self.ratio_at(step)
        return [lr * ratio for lr in self.base_lrs]


class LRRangeTest(LRSchedule):
    """lr = min_lr * (1 + step_rate * (step + 1) / step_size), whole intervals only with staircase."""

    Params = LRRangeTestParams

    def __init__(self, optimizer: torch.optim.Optimizer, lr_range_test_min_lr: PerGroup = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = self._per_group(lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self._apply()

    def lr_at(self, step: int) -> list[float]:
        intervals = (step + 1) / self.step_size
        if self.staircase:
            intervals = math.floor(intervals)
        return [lr * (1 + self.step_rate * intervals) for lr in self.min_lrs]


class OneCycle(LRSchedule):
    """The 1cycle policy: lr rises min -> max over the first half-cycle and falls back over the
    second, while momentum moves the opposite way (max -> min -> max). After the cycle, lr and
    momentum stay at their end values, or decay if decay_step_size and a decay rate are set.

    Momentum is Adam-like optimizers' betas[0] (betas[1] is kept) or SGD's momentum.
    """

    Params = OneCycleParams

    def __init__(self, optimizer: torch.optim.Optimizer, cycle_min_lr: PerGroup, cycle_max_lr: PerGroup,
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: int | None = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: int | None = None, decay_step_size: int = 0,
                 cycle_momentum: bool = True, cycle_min_mom: PerGroup = 0.8, cycle_max_mom: PerGroup = 0.9,
                 decay_mom_rate: float = 0.0, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = self._per_group(cycle_min_lr, "cycle_min_lr")
        self.max_lrs = self._per_group(cycle_max_lr, "cycle_max_lr")
        self.first_size = float(cycle_first_step_size)
        self.second_size = float(cycle_first_step_size if cycle_second_step_size is None else cycle_second_step_size)
        self.total_size = self.first_size + self.second_size
        self.first_stairs = cycle_first_stair_count
        self.second_stairs = cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        self.decay_step_size = decay_step_size
        self.decay_lr_rate = decay_lr_rate
        self.decay_mom_rate = decay_mom_rate
        self.momentum_key = _momentum_key(optimizer) if cycle_momentum else None
        if cycle_momentum and self.momentum_key is None:
            logger.warning("OneCycle: cycle_momentum is off because %s has neither betas nor momentum",
                           type(optimizer).__name__)
        self.min_moms = self._per_group(cycle_min_mom, "cycle_min_mom")
        self.max_moms = self._per_group(cycle_max_mom, "cycle_max_mom")
        self._apply()

    def _scale(self, step: int) -> float:
        """Position in the cycle as a fraction of the way from min lr to max lr."""
        it = step + 1
        x = it / self.total_size - math.floor(it / self.total_size)
        rise = self.first_size / self.total_size
        if x <= rise:
            scale, stairs = x / rise, self.first_stairs
        else:
            scale, stairs = (x - 1) / (rise - 1), self.second_stairs
        if stairs > 0:
            pos = it % self.total_size
            position = pos * stairs / self.first_size if pos <= self.first_size \
                else (self.total_size - pos) * stairs / self.second_size
            scale = math.floor(position) / stairs
        return scale

    def _decay_intervals(self, step: int, rate: float) -> float | None:
        if self.decay_step_size == 0 or rate == 0:
            return None
        return (step - self.total_size + 1) / self.decay_step_size

    def lr_at(self, step: int) -> list[float]:
        if step < self.total_size:
            scale = self._scale(step)
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        intervals = self._decay_intervals(step, self.decay_lr_rate)
        if intervals is None:
            return list(self.min_lrs)
        return [lo / (1 + self.decay_lr_rate * intervals) for lo in self.min_lrs]

    def momentum_at(self, step: int) -> list[float] | None:
        """The momentum of every param group at `step`, or None when momentum is not cycled."""
        if self.momentum_key is None:
            return None
        if step < self.total_size:
            scale = self._scale(step)
            return [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        intervals = self._decay_intervals(step, self.decay_mom_rate)
        if intervals is None:
            return list(self.max_moms)
        return [hi * (1 + self.decay_mom_rate * intervals) for hi in self.max_moms]

    def _apply(self) -> None:
        super()._apply()
        momenta = self.momentum_at(self.last_batch_iteration)
        for group, mom in zip(self.optimizer.param_groups, momenta or []):
            if self.momentum_key == "betas":
                group["betas"] = (mom, group["betas"][1])
            else:
                group["momentum"] = mom


def _momentum_key(optimizer: torch.optim.Optimizer) -> str | None:
    for key in ("betas", "momentum"):
        if key in optimizer.defaults:
            return key
    return None


SCHEDULERS: dict[str, type[LRSchedule]] = {
    cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)}
"""Type name (case-sensitive, as DeepSpeed looks it up) -> schedule class."""


def check_scheduler(type: str, params: dict) -> list[ConfigIssue]:
    """Every problem with a scheduler's type and params, at JSON paths under `scheduler.`."""
    return _validate(type, params)[2]


def resolve_scheduler_config(cfg: SchedulerConfig) -> SchedulerConfig:
    """The section with every param filled in (what will run)."""
    cls, p, issues = _validate(cfg.type, cfg.params)
    if issues:
        raise ConfigError(issues)
    return SchedulerConfig(type=cls.__name__, params=p.model_dump(mode="json"))


register_section_rules("scheduler", check_scheduler, resolve_scheduler_config)


def build_scheduler(cfg: SchedulerConfig | None, optimizer: torch.optim.Optimizer) -> LRSchedule | None:
    """The schedule a config section describes over `optimizer`; None when there is no section."""
    if cfg is None:
        return None
    cls, p, issues = _validate(cfg.type, cfg.params)
    if issues:
        raise ConfigError(issues)
    return cls(optimizer, **p.model_dump())


def _validate(type_name: Any, params: dict) -> tuple[type[LRSchedule] | None, Any, list[ConfigIssue]]:
    cls = SCHEDULERS.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        if isinstance(type_name, str):
            message = unknown_name_message("scheduler type", type_name, SCHEDULERS, name_word=True)
        else:
            message = f"expected one of {', '.join(SCHEDULERS)}, got {describe_value(type_name)}"
        return None, None, [ConfigIssue("scheduler.type", message)]
    p, issues = validate_section(cls.Params, params, "scheduler.params")
    return cls, p, issues
