"""Which part of every sequence a context-parallel rank holds, and the loss over all of them.

A sequence of T tokens is cut into 2C equal chunks; cp rank r holds chunks r and 2C-1-r
(the "zigzag" layout of Megatron-Core and of the ring-attention literature). Under a causal
mask a query chunk i needs key chunks 0..i, so rank r's two chunks need (r + 1) + (2C - r)
= 2C + 1 chunk pairs whatever r is: every rank does the same attention work.

    T = 8 tokens, C = 2: chunks of 2 tokens
    rank 0: chunks 0, 3 -> positions 0 1 6 7
    rank 1: chunks 1, 2 -> positions 2 3 4 5

Everything outside attention (embeddings, MLPs, norms, the loss) is per position, so it runs
on the local shard unchanged; only attention sees other ranks' tokens, and positions (learned
tables or RoPE) are the global ones (`positions`).

`ContextParallel` is the handle a model keeps: the cp group, this rank's place in it, the
attention method ("ring", "ulysses" or "hybrid") and, for hybrid, the two subgroups (Ulysses
inside groups of U consecutive cp ranks, the ring across them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from trident.comm import collectives
from trident.comm.logger import CommsLogger

METHODS = ("ring", "ulysses", "hybrid")


@dataclass(eq=False)
class ContextParallel:
    """The cp group of one rank and how its attention talks over it.

    `ulysses_group` / `ring_group` are the groups each phase of the attention uses: for "ring"
    the ring is the whole cp group; for "ulysses" the all-to-all is; for "hybrid" the
    all-to-all runs inside `ulysses_size` consecutive cp ranks and the ring across those groups.
    """

    group: dist.ProcessGroup | None
    size: int
    rank: int
    method: str = "ring"
    ulysses_size: int = 1
    ulysses_group: dist.ProcessGroup | None = None
    ring_group: dist.ProcessGroup | None = None
    logger: CommsLogger | None = None
    stats: dict = field(default_factory=lambda: {"block_pairs": 0, "score_elements": 0})
    doc_cache: dict = field(default_factory=dict, repr=False)
    """Gathered document ids of the forward running now, by phase (`attention.gathered_docs`)."""

    def __deepcopy__(self, memo: dict) -> ContextParallel:
        return self  # process groups cannot be copied; a copied model talks to the same ranks

    @classmethod
    def from_mesh(cls, mesh, method: str = "ring", ulysses_size: int | None = None,
                  logger: CommsLogger | None = None) -> ContextParallel:
        """The handle for `mesh`'s cp axis. Collective for "hybrid" (it creates the subgroups)."""
        size, rank = mesh.cp_size, mesh.cp_rank
        if method not in METHODS:
            raise ValueError(f"context_parallel.method must be one of {', '.join(map(repr, METHODS))}, "
                             f"got {method!r}")
        if method == "ring":
            return cls(mesh.cp_group, size, rank, method, 1, None, mesh.cp_group, logger)
        if method == "ulysses":
            return cls(mesh.cp_group, size, rank, method, size, mesh.cp_group, None, logger)
        u = ulysses_size
        if u is None or isinstance(u, bool) or not isinstance(u, int) or u < 1 or size % u:
            raise ValueError(f"context_parallel.ulysses_size={u!r} must divide context_parallel.size={size} "
                             f"for method 'hybrid' (Ulysses inside groups of ulysses_size ranks, the ring "
                             f"across them)")
        ulysses = ring = None
        for g in range(size // u):  # subgroup creation is collective: every rank makes every group
            made = mesh.subgroup("cp", list(range(g * u, (g + 1) * u)), tag="cp_ulysses")
            ulysses = made if made is not None else ulysses
        for j in range(u):
            made = mesh.subgroup("cp", list(range(j, size, u)), tag="cp_ring")
            ring = made if made is not None else ring
        return cls(mesh.cp_group, size, rank, method, u, ulysses, ring, logger)

    @classmethod
    def solo(cls) -> ContextParallel:
        """cp = 1: attention runs whole (handy for a serial reference with the same code path)."""
        return cls(None, 1, 0)

    # -- which chunks are mine --------------------------------------------------------------

    @property
    def num_chunks(self) -> int:
        return 2 * self.size

    def chunks_of(self, rank: int) -> tuple[int, int]:
        """The two global chunk indices cp rank `rank` holds: (rank, 2C - 1 - rank)."""
        return rank, self.num_chunks - 1 - rank

    def check_length(self, seq_len: int, what: str = "the input") -> None:
        if seq_len % self.num_chunks:
            raise ValueError(f"{what} has {seq_len} tokens, not divisible by 2 x context_parallel.size = "
                             f"{self.num_chunks}: every sequence is cut into 2C equal chunks (two per cp rank, "
                             f"for load balance); pad or truncate it to a multiple of {self.num_chunks}")

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's chunks of a full-sequence tensor along `dim` (a copy, contiguous)."""
        if self.size == 1:
            return x
        self.check_length(x.shape[dim])
        chunks = x.chunk(self.num_chunks, dim=dim)
        return torch.cat([chunks[c] for c in self.chunks_of(self.rank)], dim=dim)

    def positions(self, seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions (0..T-1) of this rank's tokens, in local order."""
        return self.shard(torch.arange(seq_len, device=device), dim=0)

    def unshard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The full sequence from every rank's shard (all-gather, then chunks back in order).
        No gradient flows through it: use it for logits at evaluation, not for a training loss."""
        if self.size == 1:
            return x
        pieces = [torch.empty_like(x) for _ in range(self.size)]
        collectives.all_gather_list(pieces, x.contiguous(), group=self.group, logger=self.logger)
        ordered: list[torch.Tensor | None] = [None] * self.num_chunks
        for rank, piece in enumerate(pieces):
            first, second = piece.chunk(2, dim=dim)
            a, b = self.chunks_of(rank)
            ordered[a], ordered[b] = first, second
        return torch.cat(ordered, dim=dim)

    # -- the loss ---------------------------------------------------------------------------

    def global_mean(self, local_sum: torch.Tensor, local_count: torch.Tensor | int) -> torch.Tensor:
        """The mean over every cp rank's tokens from this rank's sum and count.

        The value is the global mean on every cp rank (what a single process would report);
        the gradient is C x d(local_sum) / global_count, so that the gradient strategy's
        average over dp x cp adds the cp ranks' shares into the exact gradient of the mean.
        """
        if self.size == 1:
            return local_sum / local_count
        totals = torch.stack([local_sum.detach().float(),
                              torch.as_tensor(local_count, dtype=torch.float32, device=local_sum.device)])
        collectives.all_reduce(totals, group=self.group, logger=self.logger)
        share = local_sum * (self.size / totals[1])
        return share - share.detach() + (totals[0] / totals[1]).to(share.dtype)


def document_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool,
                  q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None) -> torch.Tensor | None:
    """Where queries at global positions `q_pos` may attend keys at `k_pos`: [Tq, Tk], or
    [B, 1, Tq, Tk] with document ids ([B, Tq], [B, Tk]). None when nothing is masked."""
    mask = None
    if causal:
        mask = q_pos.unsqueeze(-1) >= k_pos.unsqueeze(0)
    if q_doc is not None:
        same = (q_doc.unsqueeze(-1) == k_doc.unsqueeze(-2)).unsqueeze(1)
        mask = same if mask is None else same & mask
    return mask
