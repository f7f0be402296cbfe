"""A step's host work, counted: the operators it dispatches and the times the host waits for them.

On a GPU every operator that computes is a kernel launch the host must issue, and every read of
a device value on the host (`.item()`, `bool(t)`, `.tolist()`, `.cpu()`, a data-dependent shape)
stalls the host until the GPU has caught up. A 2-core CPU shows neither as time, so they are
counted instead: a `TorchDispatchMode` sees every aten operator (autograd's backward and the
collectives included) and a `TorchFunctionMode` sees the host reads that dispatch nothing on a
CPU tensor (`tolist`, `cpu`, `numpy`). The counts are deterministic, the same on CPU as on a
GPU, and tests assert them. `.cpu()` counts even on a CPU tensor (on a GPU the same line would
wait); `.to(device)` only when it really leaves a device for the host.

    with StepCost() as cost:
        loss = engine(x, y); engine.backward(loss); engine.step()
    cost.ops, cost.launches, cost.host_syncs, cost.summary()
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = frozenset({
    "aten::_local_scalar_dense",   # .item(), float(t), bool(t), int(t)
    "aten::nonzero", "aten::masked_select", "aten::unique_dim", "aten::_unique2", "aten::unique_consecutive",
    "aten::equal", "aten::is_nonzero", "aten::allclose", "aten::repeat_interleave",
})
"""Operators whose result the host must wait for (or whose output's shape depends on the data)."""

SYNC_METHODS = frozenset({"tolist", "numpy", "cpu"})
"""Tensor methods that copy device data to the host (they dispatch nothing on a CPU tensor)."""

NO_KERNEL_OPS = frozenset({"aten::detach", "aten::lift_fresh", "aten::sym_size", "aten::sym_numel",
                           "aten::sym_stride", "aten::sym_storage_offset", "aten::set_", "aten::empty",
                           "aten::empty_strided", "aten::empty_like"})


def _launches_no_kernel(func) -> bool:
    """Views, aliases, allocations and shape queries: host work, but no kernel on a GPU."""
    return func.is_view or func._schema.name in NO_KERNEL_OPS


class _HostReads(TorchFunctionMode):
    def __init__(self, cost: "StepCost") -> None:
        super().__init__()
        self.cost = cost

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in SYNC_METHODS or (name == "to" and _device_to_host(args, kwargs)):
            self.cost.host_syncs += 1
            self.cost.by_name[f"Tensor.{name}"] += 1
        return func(*args, **kwargs)


def _device_to_host(args, kwargs) -> bool:
    """`t.to("cpu")` of a tensor that is not on the CPU (the same call on a CPU tensor is a no-op)."""
    device = kwargs.get("device", args[1] if len(args) > 1 else None)
    return (isinstance(device, (str, torch.device)) and torch.device(device).type == "cpu"
            and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu")


class StepCost(TorchDispatchMode):
    """Counts aten operators (`ops`), those that launch a kernel (`launches`) and host syncs."""

    def __init__(self) -> None:
        super().__init__()
        self.by_name: Counter[str] = Counter()
        self.ops = 0
        self.launches = 0
        self.host_syncs = 0
        self._reads = _HostReads(self)

    def __enter__(self):
        self._reads.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._reads.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        self.by_name[name] += 1
        self.ops += 1
        if not _launches_no_kernel(func):
            self.launches += 1
        if name in SYNC_OPS:
            self.host_syncs += 1
        return func(*args, **(kwargs or {}))

    def summary(self, top: int = 12) -> str:
        """One line: totals and the most frequent operators."""
        common = ", ".join(f"{n.removeprefix('aten::')} {c}" for n, c in self.by_name.most_common(top))
        return f"{self.ops} ops ({self.launches} launch kernels), {self.host_syncs} host syncs; {common}"
