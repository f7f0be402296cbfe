"""What a worker gets back as `optimizer` and `lr_scheduler`: read-only views of the servers'.

The optimizer and the lr schedule run on the servers, shard by shard. Scripts written for
DeepSpeed read the learning rate from them (`optimizer.param_groups[0]["lr"]`,
`lr_scheduler.get_last_lr()`); these views answer with the servers' values as of the last pull,
and say where to go instead for everything that would change them.
"""

from __future__ import annotations

from typing import Any, Protocol


class _LearningRates(Protocol):
    def get_lr(self) -> list[float]: ...

_WHERE = ("runs on the parameter servers (parameter_server.servers > 0); engine.step() drives it and "
          "engine.save_checkpoint / load_checkpoint save and restore its state")


class RemoteOptimizer:
    """`param_groups` with the servers' learning rates; stepping or saving it here is an error."""

    def __init__(self, source: _LearningRates) -> None:
        self._source = source  # the worker's PushPullStrategy: the learning rates of its last pull

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [{"lr": lr} for lr in self._source.get_lr()]

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"optimizer.step() on a worker: the optimizer {_WHERE}")

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"optimizer.zero_grad() on a worker: the optimizer {_WHERE}; engine.step() starts "
                           "the next accumulation window itself")

    def state_dict(self) -> dict:
        raise RuntimeError(f"optimizer.state_dict() on a worker: the optimizer {_WHERE}")


class RemoteSchedule:
    """`get_last_lr()` / `get_lr()` from the servers; stepping it here is an error."""

    def __init__(self, source: _LearningRates) -> None:
        self._source = source  # the worker's PushPullStrategy: the learning rates of its last pull

    def get_last_lr(self) -> list[float]:
        return self._source.get_lr()

    def get_lr(self) -> list[float]:
        return self._source.get_lr()

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"lr_scheduler.step() on a worker: the schedule {_WHERE}")

    def state_dict(self) -> dict:
        raise RuntimeError(f"lr_scheduler.state_dict() on a worker: the schedule {_WHERE}")
