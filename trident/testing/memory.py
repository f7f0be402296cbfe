"""Bytes of live tensors, counted by storage, for tests and benchmarks of activation memory.

A TorchDispatchMode sees every tensor an operator returns. Each new storage is counted when it
appears and uncounted when it is freed (a weakref finaliser on the storage), so `peak` is the
most bytes of operator-made tensors alive at once and `live` the bytes alive now. Storages that
existed before (model states) are excluded by passing their data pointers. This is what autograd
and the step keep, without an allocator's rounding or caching (which CPU memory has no reliable
way to report).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of storages created by operators while active, now and at their peak."""

    def __init__(self, preexisting: set[int]) -> None:
        super().__init__()
        self.preexisting, self.alive = preexisting, set()
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":  # meta tensors hold no memory
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes and key not in self.alive and key not in self.preexisting:
                    self.alive.add(key)
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, nbytes)
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self.alive.discard(key)
        self.live -= nbytes
