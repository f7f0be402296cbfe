"""The 1-bit compressed all-reduce of 1-bit Adam, 0/1 Adam and 1-bit LAMB.

What crosses the wire is one bit per element (its sign, packed 8 to a byte) plus one fp32
scale per segment and rank, instead of 32 bits per element. The average it computes is
approximate; the error of each compression is kept and added to the next call's input (error
feedback, Tang et al. 2021, "1-bit Adam"), so over steps nothing is lost. Two compressions
happen per call, as in the paper and in DeepSpeed's `compressed_allreduce`:

    worker  x_r  = input_r + worker_error_r             (every rank r, whole vector)
            a_r  = ||x_r|| / sqrt(n) per segment         worker_error_r = x_r - a_r * sign(x_r)
                    -- one all-to-all of the packed signs (scales riding along): rank c receives chunk c
               of every rank's compressed vector (a reduce-scatter, in signs) --
    server  y_c  = mean_r(a_r * sign(x_r)[chunk c]) + server_error_c
            b_c  = ||y_c|| / sqrt(n / world) per segment  server_error_c = y_c - b_c * sign(y_c)
            -- one all-gather of the packed server signs and their scales --
    result  = concat_c(b_c * sign(y_c))                 (the same on every rank)

sign(0) is +1. A *segment* is a run of the vector with its own scale (one per parameter for
1-bit Adam and 0/1 Adam; the whole momentum for 1-bit LAMB); each is zero-padded to a
multiple of 8 x world so every rank's chunk of it packs into whole bytes. The padding takes
part in the maths (as in DeepSpeed, whose padding is coarser: world x lcm(world, 8)).

The same code runs over gloo (CPU tensors) and NCCL (device tensors): only all_to_all and
all_gather of uint8 are used. With one rank the average is the input itself, so the
call returns it unchanged and keeps no error.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from trident.comm import collectives
from trident.comm.logger import CommsLogger
from trident.compression.error_feedback import ErrorFeedback

_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
_SHIFTS = torch.arange(7, -1, -1, dtype=torch.uint8)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """One bit per element of `x` (1 where x >= 0), 8 to a byte, first element in the high bit.
    The last dim must be a multiple of 8; the result has 1/8 of its length."""
    bits = (x >= 0).to(torch.uint8).reshape(*x.shape[:-1], -1, 8)
    return (bits * _BIT_WEIGHTS.to(x.device)).sum(-1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The +1 / -1 values `pack_signs` packed (8 per byte, along the last dim)."""
    bits = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 1
    return bits.reshape(*packed.shape[:-1], -1).to(dtype).mul_(2).sub_(1)


def signed(x: torch.Tensor) -> torch.Tensor:
    """sign(x) with sign(0) = +1: what one bit per element can say."""
    return torch.where(x >= 0, 1.0, -1.0).to(x.dtype)


class CompressedAllReduce:
    """Averages a vector cut into segments of `numels` over `group`, in signs and scales.

    Keeps this rank's error buffers (`self.errors`: a `trident.compression.ErrorFeedback`);
    `__call__` takes the tensors (one per segment, any shapes) and overwrites them with the
    approximate average.
    """

    def __init__(self, numels: list[int], group: dist.ProcessGroup | None, device: torch.device,
                 logger: CommsLogger | None = None) -> None:
        self.group, self.logger = group, logger
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.numels = list(numels)
        unit = 8 * self.world
        self.padded = [max(unit, -(-n // unit) * unit) for n in self.numels]
        self.chunks = [p // self.world for p in self.padded]  # each rank's share of each segment
        self.errors = ErrorFeedback(sum(self.padded), sum(self.chunks), device)

    @torch.no_grad()
    def __call__(self, tensors: list[torch.Tensor]) -> None:
        if self.world == 1:
            return
        if [t.numel() for t in tensors] != self.numels:
            raise ValueError(f"compressed all-reduce built for segments of {self.numels} elements, got "
                             f"{[t.numel() for t in tensors]}")
        x = self._padded_input(tensors).add_(self.errors.worker)
        scales = self._segment_norms(x, self.padded)
        self.errors.worker.copy_(x - self._expand(scales, self.padded) * signed(x))
        recv_signs, recv_scales = self._exchange_chunks(x, scales)
        y = (unpack_signs(recv_signs) * self._expand_rows(recv_scales)).sum(0).div_(self.world)
        y.add_(self.errors.server)
        server_scales = self._segment_norms(y, self.chunks)
        self.errors.server.copy_(y - self._expand(server_scales, self.chunks) * signed(y))
        result = self._gather_result(y, server_scales)
        self._write_back(result, tensors)

    # -- pieces --------------------------------------------------------------------------------

    def _padded_input(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The segments as fp32, each zero-padded to its padded length, back to back."""
        x = torch.zeros(sum(self.padded), dtype=torch.float32, device=self.errors.worker.device)
        start = 0
        for t, n, p in zip(tensors, self.numels, self.padded):
            x[start:start + n].copy_(t.reshape(-1))
            start += p
        return x

    def _segment_norms(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """||segment|| / sqrt(len(segment)) for each segment: the scale whose signs best
        approximate it in L2."""
        pieces = torch.split(x, lengths)
        return torch.stack([torch.linalg.vector_norm(p) / math.sqrt(p.numel()) for p in pieces])

    def _expand(self, scales: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        return torch.repeat_interleave(scales, torch.tensor(lengths, device=scales.device))

    def _expand_rows(self, scales: torch.Tensor) -> torch.Tensor:
        """(world, segments) scales -> (world, sum of chunks): each rank's scale over its chunk columns."""
        return torch.repeat_interleave(scales, torch.tensor(self.chunks, device=scales.device), dim=1)

    def _by_destination(self, x: torch.Tensor) -> torch.Tensor:
        """(world, sum of chunks): row c holds chunk c of every segment of `x`."""
        return torch.cat([seg.view(self.world, -1) for seg in torch.split(x, self.padded)], dim=1)

    def _exchange_chunks(self, x: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Send chunk c of our signs, with our scales, to rank c (one all-to-all); returns the
        (world, chunk bytes) signs and (world, segments) scales every rank sent us."""
        packed = pack_signs(self._by_destination(x))
        payload = torch.cat([packed, _as_bytes(scales).expand(self.world, -1)], dim=1).contiguous()
        recv = torch.empty_like(payload)
        collectives.all_to_all(recv, payload, group=self.group, logger=self.logger)
        return _split_payload(recv, packed.shape[1])

    def _gather_result(self, y: torch.Tensor, server_scales: torch.Tensor) -> torch.Tensor:
        """Every rank's server-compressed chunk, decompressed: (world, sum of chunks)."""
        packed = pack_signs(y)
        payload = torch.cat([packed, _as_bytes(server_scales)])
        gathered = torch.empty(self.world, payload.numel(), dtype=payload.dtype, device=payload.device)
        collectives.all_gather(gathered, payload, group=self.group, logger=self.logger)
        signs, scales = _split_payload(gathered, packed.numel())
        return unpack_signs(signs) * self._expand_rows(scales)

    def _write_back(self, result: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        """Undo `_by_destination`: segment s is the rows' column block s, row after row."""
        for t, n, block in zip(tensors, self.numels, torch.split(result, self.chunks, dim=1)):
            t.copy_(block.reshape(-1)[:n].view_as(t))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of fp32 `t`, so scales travel in the same message as the signs."""
    return t.contiguous().view(torch.uint8)


def _split_payload(rows: torch.Tensor, sign_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(world, sign bytes + scale bytes) rows -> (signs, fp32 scales)."""
    return rows[:, :sign_bytes], rows[:, sign_bytes:].contiguous().view(torch.float32)
