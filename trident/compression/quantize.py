"""Blockwise symmetric quantization into one flat byte payload per row (ZeRO++'s qwZ and qgZ).

A row of n values is cut into `blocks(n)` blocks of equal length (the last padded with zeros).
Each block keeps one fp32 scale, absmax / qmax with qmax = 2**(bits-1) - 1, and its values as
round(x / scale) in [-qmax, qmax]. Dequantizing gives q * scale, so every element is off by at
most scale / 2 = absmax(block) / (2 qmax): 1/254 of its block's largest magnitude at 8 bits,
1/14 at 4 bits (plus the float rounding of x / scale, about 2**-24 of absmax).

The payload of a row is its codes (one byte each at 8 bits, two per byte at 4 bits) followed by
its scales' bytes, so a shard and its scales travel in one collective as one uint8 tensor.
Rows are independent: rank i's row can be dequantized by anyone from its bytes alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockQuantizer:
    """Symmetric `bits`-bit quantization (8 or 4) with blocks of at most `block` elements."""

    bits: int
    block: int

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 8 or 4, got {self.bits}")
        if self.block < 2 or self.block % 2:
            raise ValueError(f"block must be an even number >= 2, got {self.block}")

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def layout(self, n: int) -> tuple[int, int]:
        """(blocks, elements per block) for a row of n: as few blocks as `block` allows, of
        equal, even length, so padding stays below 2 elements per block."""
        if n < 1:
            raise ValueError(f"cannot quantize an empty row (n={n})")
        count = -(-n // self.block)
        length = -(-n // count)
        return count, length + (length % 2)

    def payload_bytes(self, n: int) -> int:
        """Bytes of one quantized row of n elements (codes, then fp32 scales)."""
        count, length = self.layout(n)
        return count * length * self.bits // 8 + 4 * count

    @torch.no_grad()
    def quantize(self, rows: torch.Tensor) -> torch.Tensor:
        """[r, n] (any float dtype) -> [r, payload_bytes(n)] uint8."""
        r, n = rows.shape
        count, length = self.layout(n)
        x = torch.zeros(r, count * length, dtype=torch.float32, device=rows.device)
        x[:, :n] = rows
        x = x.view(r, count, length)
        scale = x.abs().amax(dim=2, keepdim=True) / self.qmax
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(x / scale).clamp_(-self.qmax, self.qmax).to(torch.int8).view(r, -1)
        if self.bits == 8:
            codes = q.view(torch.uint8)
        else:
            nibbles = (q + 8).to(torch.uint8)
            codes = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
        return torch.cat([codes, scale.view(r, count).view(torch.uint8)], dim=1)

    @torch.no_grad()
    def dequantize(self, payload: torch.Tensor, n: int, dtype: torch.dtype = torch.float32,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """[r, payload_bytes(n)] uint8 -> [r, n] in `dtype` (written into `out` when given)."""
        r = payload.shape[0]
        count, length = self.layout(n)
        code_bytes = count * length * self.bits // 8
        scale = payload[:, code_bytes:].contiguous().view(torch.float32).view(r, count, 1)
        codes = payload[:, :code_bytes]
        if self.bits == 8:
            q = codes.contiguous().view(torch.int8).to(torch.float32)
        else:
            q = torch.stack([codes & 0x0F, codes >> 4], dim=2).view(r, -1).to(torch.float32) - 8
        values = (q.view(r, count, length) * scale).view(r, -1)[:, :n]
        if out is None:
            return values.to(dtype)
        out.copy_(values)
        return out

    def error_bound(self, rows: torch.Tensor) -> torch.Tensor:
        """Per element, the largest |dequantize(quantize(x)) - x|: absmax of its block / (2 qmax),
        with a 2**-20 relative allowance for the float rounding of x / scale and q * scale."""
        r, n = rows.shape
        count, length = self.layout(n)
        x = torch.zeros(r, count * length, dtype=torch.float32, device=rows.device)
        x[:, :n] = rows
        absmax = x.view(r, count, length).abs().amax(dim=2, keepdim=True)
        bound = absmax * (0.5 / self.qmax + 2.0 ** -20)
        return bound.expand(r, count, length).reshape(r, -1)[:, :n]


WEIGHTS = BlockQuantizer(bits=8, block=4096)
"""qwZ: int8, blocks of up to 4096 elements (DeepSpeed's weight quantizer aims at groups of 4-8k)."""

GRADIENTS = BlockQuantizer(bits=4, block=512)
"""qgZ: int4 (the ZeRO++ paper's gradient precision), smaller blocks to keep the error down."""
