"""The error buffers of a compressed all-reduce (error feedback).

Each compression leaves an error (what the signs and scale did not say); adding it to the next
input makes the errors telescope, so the sum over steps of what was sent equals the sum of
what should have been sent, up to the last error. A rank keeps two: the worker error over the
whole vector it compresses, and the server error over the chunk it averages for everyone.
They differ between ranks, so checkpoints save them per rank and restore them exactly (unlike
DeepSpeed, which drops them at every load).
"""

from __future__ import annotations

import torch


class ErrorFeedback:
    """A rank's worker error (whole padded vector) and server error (its chunk), fp32."""

    def __init__(self, worker_numel: int, server_numel: int, device: torch.device) -> None:
        self.worker = torch.zeros(worker_numel, dtype=torch.float32, device=device)
        self.server = torch.zeros(server_numel, dtype=torch.float32, device=device)

    def reset(self) -> None:
        """Forget the accumulated errors (0/1 Adam does this when it starts its local steps,
        because the compressed quantity changes from gradients to accumulated updates)."""
        self.worker.zero_()
        self.server.zero_()

    def nbytes(self) -> int:
        return (self.worker.numel() + self.server.numel()) * 4

    def state_dict(self) -> dict:
        return {"worker_error": self.worker.clone(), "server_error": self.server.clone()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for name, buf in (("worker_error", self.worker), ("server_error", self.server)):
            saved = state[name]
            if saved.shape != buf.shape:
                raise ValueError(f"saved {name} has {saved.numel()} elements, this run's has {buf.numel()}: the "
                                 "checkpoint was written with another data-parallel size or model; error "
                                 "buffers are per rank and only load under the layout that wrote them")
            buf.copy_(saved)
