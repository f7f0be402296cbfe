"""Ring attention: queries stay, key/value shards travel around the ring.

Each of R ring ranks holds the queries, keys and values of some chunks of the sequence. In R
steps every rank sees every rank's keys and values: at step s it computes its queries against
the block that came from rank (r - s) mod R, while the next block is already on its way (the
send to r + 1 and the receive from r - 1 are posted before the compute they feed).

Partial results are merged exactly with the log-sum-exp rule: a block gives its normalised
output o_b and the log of its softmax denominator lse_b; with the running (o, lse)

    lse' = log(e^lse + e^lse_b),   o' = o e^(lse - lse') + o_b e^(lse_b - lse')

which is softmax over the union of the keys seen so far. The backward keeps only q, k, v,
the output and the final lse (not the probabilities), runs the ring again, and recomputes each
block's probabilities as exp(s - lse). dQ accumulates where the queries are; dK and dV travel
with their block, gathering every rank's share, and after R steps arrive back at their owner.

Work is cut into pairs of chunks (one query chunk, one key chunk). Under a causal mask a pair
whose key chunk is after its query chunk is skipped, an earlier one is computed unmasked, and
the diagonal pair with the causal triangle; document ids of packed sequences add a mask to
any pair. `ContextParallel.stats` counts the pairs and the attended (query, key) entries,
which is what the load-balance test compares across ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trident.comm import p2p
from trident.comm.logger import CommsLogger
from trident.context_parallel.layout import document_mask


@dataclass
class RingPlan:
    """What one ring attention call needs besides q, k and v.

    `chunk_sets[i]`: the global chunk indices ring rank i holds, in local order;
    `chunk_len`: tokens per chunk; `docs[i]`: ring rank i's document ids [B, tokens] or None.
    """

    group: object
    size: int
    rank: int
    chunk_sets: list[tuple[int, ...]]
    chunk_len: int
    causal: bool
    docs: list[torch.Tensor] | None
    scale: float
    logger: CommsLogger | None
    stats: dict | None

    def pairs(self, src: int):
        """(query slice, key slice, mask) for every chunk pair computed at the step whose keys came
        from ring rank `src`."""
        length = self.chunk_len
        for qi, qc in enumerate(self.chunk_sets[self.rank]):
            for ki, kc in enumerate(self.chunk_sets[src]):
                if self.causal and kc > qc:
                    continue
                qs, ks = slice(qi * length, (qi + 1) * length), slice(ki * length, (ki + 1) * length)
                diagonal = self.causal and kc == qc
                mask = None
                if self.docs is not None:  # explicit: a document mask may hide whole rows of a block
                    q_pos = torch.arange(qc * length, (qc + 1) * length)
                    k_pos = torch.arange(kc * length, (kc + 1) * length)
                    mask = document_mask(q_pos, k_pos, diagonal, self.docs[self.rank][:, qs], self.docs[src][:, ks])
                yield qs, ks, Block(diagonal, mask)

    def count(self, q: torch.Tensor, block: Block) -> None:
        if self.stats is None:
            return
        b, h, length, d = q.shape
        if block.mask is not None:
            entries = int(block.mask.expand(b, 1, length, length).sum()) // b
        else:
            entries = length * (length + 1) // 2 if block.causal else length * length
        self.stats["block_pairs"] += 1
        self.stats["score_elements"] += b * h * entries

    # -- the two passes -------------------------------------------------------------------------

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Output (float32, normalised) and the log-sum-exp of every query row."""
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1] + (1,), -math.inf, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        for step in range(self.size):
            src = (self.rank - step) % self.size
            pending = self._pass_on(kv) if step < self.size - 1 else None
            k_src, v_src = _expand_heads(kv[0], q.shape[1]), _expand_heads(kv[1], q.shape[1])
            for qs, ks, block in self.pairs(src):
                self.count(q[:, :, qs], block)
                o_b, lse_b = _block_forward(q[:, :, qs], k_src[:, :, ks], v_src[:, :, ks], block, self.scale)
                out[:, :, qs], lse[:, :, qs] = _merge(out[:, :, qs], lse[:, :, qs], o_b.float(), lse_b)
            if pending is not None:
                kv = pending()
        return out, lse

    def backward(self, q, k, v, out, lse, dout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dQ here; each block's dK, dV gathered as the block's gradient travels the ring behind
        it (its send overlaps the next block's compute) and arrives home after R passes."""
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        heads, kv_heads = q.shape[1], k.shape[1]
        travelling = None  # the gradient of the block held now, accumulated by the ranks before
        for step in range(self.size):
            src = (self.rank - step) % self.size
            pending = self._pass_on(kv) if step < self.size - 1 else None
            k_src, v_src = _expand_heads(kv[0], heads), _expand_heads(kv[1], heads)
            dk = torch.zeros(k_src.shape, dtype=torch.float32, device=k.device)
            dv = torch.zeros_like(dk)
            for qs, ks, block in self.pairs(src):
                dq_b, dk_b, dv_b = _block_backward(q[:, :, qs], k_src[:, :, ks], v_src[:, :, ks], dout[:, :, qs],
                                                   out[:, :, qs], lse[:, :, qs], block, self.scale)
                dq[:, :, qs] += dq_b
                dk[:, :, ks] += dk_b
                dv[:, :, ks] += dv_b
            mine = torch.stack([_fold_heads(dk, kv_heads), _fold_heads(dv, kv_heads)])
            grad = mine if travelling is None else travelling() + mine
            travelling = self._pass_on(grad) if self.size > 1 else (lambda g=grad: g)
            if pending is not None:
                kv = pending()
        dkv = travelling()  # after R passes, this rank's own block
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)

    def _pass_on(self, tensor: torch.Tensor):
        """Send `tensor` to the next ring rank and receive the previous rank's; returns a function
        that waits and gives the received tensor."""
        received = torch.empty_like(tensor)
        nxt, prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        handles = [p2p.isend(tensor, nxt, group=self.group, logger=self.logger),
                   p2p.irecv(received, prev, group=self.group, logger=self.logger)]

        def wait() -> torch.Tensor:
            for handle in handles:
                handle.wait()
            return received
        return wait


class RingAttention(torch.autograd.Function):
    """Autograd wrapper of `RingPlan`: q, k, v [B, H, T_local, D] -> [B, H, T_local, D]."""

    @staticmethod
    def forward(ctx, q, k, v, plan: RingPlan):
        out, lse = plan.forward(q, k, v)
        out = out.to(q.dtype)  # kept in the input's precision; lse in fp32
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.plan.backward(q, k, v, out, lse, dout)
        return dq, dk, dv, None


# -- one block --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """One chunk pair: `causal` for the diagonal pair (query and key chunk the same), `mask` an
    explicit [B, 1, Lq, Lk] mask when document ids apply (None otherwise)."""

    causal: bool
    mask: torch.Tensor | None


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _fused(q: torch.Tensor, block: Block) -> bool:
    """PyTorch's CPU flash-attention kernels take the block (no score matrix in memory, lse out)
    when no explicit mask applies; elsewhere (CUDA, document masks) the block runs as plain
    tensor maths below."""
    return _FLASH_CPU is not None and q.device.type == "cpu" and block.mask is None


def _block_forward(q, k, v, block: Block, scale: float):
    """Softmax attention of one block: its normalised output and per-row log-sum-exp [.., L, 1]
    (-inf for rows with no allowed key, whose output is 0)."""
    if _fused(q, block):
        out, lse = _FLASH_CPU(q, k, v, 0.0, block.causal, scale=scale)
        return out, lse.unsqueeze(-1).float()
    q, k, v = q.float(), k.float(), v.float()
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    mask = _mask(block, q.shape[-2], k.shape[-2], q.device)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    out = torch.matmul(p, v) / denom.clamp_min(torch.finfo(denom.dtype).tiny)
    return out, m + torch.log(denom)


def _merge(out, lse, o_b, lse_b):
    new = torch.logaddexp(lse, lse_b)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # no key seen yet in either
    return out * torch.exp(lse - safe) + o_b * torch.exp(lse_b - safe), new


def _block_backward(q, k, v, dout, out, lse, block: Block, scale: float):
    """dQ, dK, dV of one block (float32), from the *final* output and log-sum-exp of the rows:
    P = exp(S - lse) is then the block's share of the whole softmax, and D = rowsum(dO * O)."""
    if _fused(q, block):
        grads = _FLASH_CPU_BACKWARD(dout, q, k, v, out, lse.squeeze(-1), 0.0, block.causal, scale=scale)
        return tuple(g.float() for g in grads)
    q, k, v, dout, out = q.float(), k.float(), v.float(), dout.float(), out.float()
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe)
    mask = _mask(block, q.shape[-2], k.shape[-2], q.device)
    if mask is not None:
        p = p.masked_fill(~mask, 0.0)
    dv = torch.matmul(p.transpose(-1, -2), dout)
    ds = p * (torch.matmul(dout, v.transpose(-1, -2)) - (dout * out).sum(-1, keepdim=True))
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale
    return dq, dk, dv


def _mask(block: Block, lq: int, lk: int, device) -> torch.Tensor | None:
    if block.mask is not None:
        return block.mask
    if block.causal:
        return torch.ones(lq, lk, dtype=torch.bool, device=device).tril()
    return None


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query attention: repeat each key/value head for the query heads that share it."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _fold_heads(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of `_expand_heads`: sum over the query heads sharing a key/value head."""
    b, h, t, d = grad.shape
    return grad if h == kv_heads else grad.view(b, kv_heads, h // kv_heads, t, d).sum(2)
