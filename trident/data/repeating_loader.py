"""A data loader that starts over when it runs out (`deepspeed.utils.RepeatingLoader`; the pipeline
engine repeats its training loader with it)."""

from __future__ import annotations

from typing import Any, Iterable, Iterator


class RepeatingLoader:
    """Iterate `loader` forever: at its end, start a new pass. As DeepSpeed's, every pass is the
    same epoch of the sampler (DeepSpeed never calls `set_epoch`); `reshuffle=True` calls the
    sampler's `set_epoch` with the pass number, when it has one, so each pass reshuffles."""

    def __init__(self, loader: Iterable, reshuffle: bool = False) -> None:
        self.loader = loader
        self.reshuffle = reshuffle
        self.epoch = 0
        self._it = iter(loader)

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._it)
        except StopIteration:
            self.epoch += 1
            sampler = getattr(self.loader, "sampler", None)
            if self.reshuffle and hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self.epoch)
            self._it = iter(self.loader)
            return next(self._it)
