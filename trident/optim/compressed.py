"""What the 1-bit optimizers (OneBitAdam, ZeroOneAdam, OneBitLamb) share: the compressed
all-reduce they call from inside `step`, the switch that tells the engine whether the coming
step wants dp-averaged gradients, and a state dict that carries their counters and error
buffers.

These optimizers communicate themselves. During warm-up the engine averages gradients as for
any optimizer (DeepSpeed's `enable_backward_allreduce`); once compression starts, each rank
hands its *local* gradient to `step`, which averages momentum (or accumulated updates) through
`trident.compression.onebit.CompressedAllReduce`. `trident.data_parallel.compressed` is the
gradient strategy that asks `wants_averaged_gradients()` before every accumulation window;
nothing in the engine knows these optimizers by name.

On one process (or before `bind` is called) the compressed all-reduce is the identity: the
optimizer is then its own uncompressed twin.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from trident.compression.onebit import CompressedAllReduce

COMM_BACKENDS = ("nccl", "mpi", "hccl", "compressed", "gloo")
"""DeepSpeed's `comm_backend_name` values (and gloo). trident runs one compressed all-reduce
over the data-parallel process group whatever its backend, so the name selects nothing."""


def check_common(freeze_name: str, freeze_step: int, comm_backend_name: str, amsgrad: bool, kind: str) -> None:
    """The argument checks every 1-bit optimizer makes (the config path checks them first)."""
    if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 0:
        raise ValueError(f"{kind}: {freeze_name} must be an integer >= 0 (the number of uncompressed warm-up "
                         f"steps), got {freeze_step!r}")
    if comm_backend_name not in COMM_BACKENDS:
        raise ValueError(f"{kind}: comm_backend_name must be one of {', '.join(COMM_BACKENDS)}, got "
                         f"{comm_backend_name!r}")
    if amsgrad:
        raise ValueError(f"{kind} does not support the AMSGrad variant (DeepSpeed's neither); set amsgrad to false")


class CompressedOptimizer(torch.optim.Optimizer):
    """Base of the 1-bit optimizers: `policy` holds their step counters (saved with the
    optimizer state), `_comm` the compressed all-reduce once `bind` gave it a group."""

    def __init__(self, params: Iterable, defaults: dict, policy: dict) -> None:
        super().__init__(params, defaults)
        self.policy = dict(policy, step=0)
        self._comm: CompressedAllReduce | None = None

    # -- what subclasses say ---------------------------------------------------------------

    def segments(self) -> list[int]:
        """Element counts of the runs the compressed all-reduce scales separately."""
        return [p.numel() for p in self.params()]

    def wants_averaged_gradients(self) -> bool:
        """Whether the coming step expects gradients averaged over the data-parallel group
        (True) or this rank's own (False: it will communicate in compressed form itself)."""
        raise NotImplementedError

    # -- shared machinery ------------------------------------------------------------------

    def params(self) -> list[torch.nn.Parameter]:
        return [p for g in self.param_groups for p in g["params"]]

    def bind(self, group: dist.ProcessGroup | None, logger=None) -> None:
        """Communicate over `group` (the data-parallel group), logging into `logger`."""
        params = self.params()
        device = params[0].device if params else torch.device("cpu")
        self._comm = CompressedAllReduce(self.segments(), group, device, logger)

    @property
    def world(self) -> int:
        return self._comm.world if self._comm is not None else 1

    def compressed_average(self, tensors: list[torch.Tensor]) -> None:
        """Overwrite `tensors` (one per segment) with their approximate dp average."""
        if self._comm is not None:
            self._comm(tensors)

    def reset_errors(self) -> None:
        if self._comm is not None:
            self._comm.errors.reset()

    def error_bytes(self) -> int:
        return self._comm.errors.nbytes() if self._comm is not None else 0

    @staticmethod
    def grad_of(p: torch.Tensor) -> torch.Tensor:
        """The gradient, zeros for a parameter that got none (every segment is always sent)."""
        return p.grad if p.grad is not None else torch.zeros_like(p)

    def state_dict(self) -> dict:
        """torch's optimizer state plus `compression`: the counters and this rank's error buffers."""
        sd = super().state_dict()
        errors = self._comm.errors.state_dict() if self._comm is not None else None
        sd["compression"] = {"policy": dict(self.policy), "errors": errors}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        saved = state_dict.pop("compression", None)
        super().load_state_dict(state_dict)
        if saved is None:
            return
        self.policy.update(saved["policy"])
        if saved["errors"] is not None and self._comm is not None:
            self._comm.errors.load_state_dict(saved["errors"])
