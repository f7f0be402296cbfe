"""Random streams for tensor parallelism: what differs per tp rank and what must not.

Two regions, as in Megatron-LM:

- The *default region* is torch's default generator. Tensors outside the split region (the
  residual stream, the embedding output) are replicated over the tp ranks, so their dropout
  must draw the same masks on every tp rank: every rank seeds the default generator with the
  same seed and draws the same shapes in the same order. This module never touches it except
  inside `fork`.
- The *model-parallel region* holds tensors split over the tp ranks (the heads of an
  attention block). Each rank draws from streams of its own: `"model-parallel"` is seeded
  with seed + 2718 + tp_rank (Megatron's offset), so masks differ per tp rank.

*Unit streams* refine the model-parallel region so that the masks do not depend on the tp
size: a layer that splits a dimension into units (heads) draws unit u's mask from a stream of
its own, seeded from (seed, name, u). A rank holds only the streams of its units, so ranks
still draw differently, and one process holding every unit draws exactly the same masks. The
reference GPT uses them for attention dropout; that is what lets a tp=4 run with dropout
reproduce the losses of one process.

Recomputation (activation checkpointing) must replay the same masks: `get_states` /
`set_states` capture and restore every stream, and `checkpoint_contexts` plugs that into
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False, context_fn=...)`.
"""

from __future__ import annotations

import contextlib
import zlib
from typing import Iterator

import torch

MODEL_PARALLEL = "model-parallel"
MODEL_PARALLEL_SEED_OFFSET = 2718  # Megatron-LM's offset between the default and model-parallel seeds
_UNIT_SEED_STRIDE = 1_000_003  # a prime: unit streams of different names and seeds do not collide


def _default_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_default_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def unit_seed(seed: int, name: str, unit: int) -> int:
    """The seed of unit `unit`'s stream in family `name`: independent of the tp layout."""
    return (seed * _UNIT_SEED_STRIDE + zlib.crc32(name.encode()) + MODEL_PARALLEL_SEED_OFFSET + unit) % (2 ** 63)


class RNGTracker:
    """Named generators for the model-parallel region of one tp rank.

    `seed` must be the same on every rank (it is the run's seed); `tp_rank` picks this rank's
    model-parallel stream. Streams are torch.Generators on `device`: pass one to
    `bernoulli_(p, generator=...)`, or `fork` to route code that uses the default generator
    (nn.Dropout) through a stream.
    """

    def __init__(self, seed: int, tp_rank: int = 0, device: torch.device | str = "cpu") -> None:
        if tp_rank < 0:
            raise ValueError(f"RNGTracker tp_rank must be >= 0, got {tp_rank}")
        self.seed = int(seed)
        self.tp_rank = tp_rank
        self.device = torch.device(device)
        self._generators: dict[str, torch.Generator] = {}
        self.add(MODEL_PARALLEL, self.seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank)

    @classmethod
    def for_mesh(cls, seed: int, mesh, device: torch.device | str = "cpu") -> RNGTracker:
        """The tracker of this rank of `mesh` (a ParallelMesh): its tp rank picks the stream."""
        return cls(seed, tp_rank=mesh.tp_rank, device=device)

    def add(self, name: str, seed: int) -> None:
        """Create stream `name` seeded with `seed`; each name once."""
        if name in self._generators:
            raise ValueError(f"RNG stream {name!r} already exists (seeded once, at start-up); pick another name")
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        self._generators[name] = gen

    def generator(self, name: str = MODEL_PARALLEL) -> torch.Generator:
        """The generator of stream `name`."""
        if name not in self._generators:
            raise KeyError(f"no RNG stream named {name!r}; streams: {sorted(self._generators)}")
        return self._generators[name]

    def unit_generators(self, name: str, units: range) -> list[torch.Generator]:
        """The streams of units `units` of family `name`, created on first use from `unit_seed`."""
        gens = []
        for unit in units:
            key = f"{name}/{unit}"
            if key not in self._generators:
                self.add(key, unit_seed(self.seed, name, unit))
            gens.append(self._generators[key])
        return gens

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL) -> Iterator[None]:
        """Inside the block, the default generator *is* stream `name`; outside, it is untouched.

        On exit the stream keeps its advanced state and the default generator gets back the
        state it had on entry, so the default region's sequence does not see the block.
        """
        gen = self.generator(name)
        saved = _default_state(self.device)
        _set_default_state(self.device, gen.get_state())
        try:
            yield
        finally:
            gen.set_state(_default_state(self.device))
            _set_default_state(self.device, saved)

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every stream's state, by name."""
        return {name: gen.get_state() for name, gen in self._generators.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Restore streams from `get_states()`; every named stream must exist."""
        unknown = set(states) - set(self._generators)
        if unknown:
            raise KeyError(f"set_states: unknown RNG streams {sorted(unknown)}; this tracker has "
                           f"{sorted(self._generators)}")
        for name, state in states.items():
            self._generators[name].set_state(state)

    def checkpoint_contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """`context_fn` for torch.utils.checkpoint: recomputation replays this tracker's streams.

        The first context records the streams' states as the forward starts; the second sets
        them back for the recomputation and afterwards restores the states they had reached.
        (torch's `preserve_rng_state` does the same for the default generator.)
        """
        saved: dict[str, torch.Tensor] = {}

        @contextlib.contextmanager
        def forward() -> Iterator[None]:
            saved.update(self.get_states())
            yield

        @contextlib.contextmanager
        def recompute() -> Iterator[None]:
            current = self.get_states()
            self.set_states(saved)
            try:
                yield
            finally:
                self.set_states(current)

        return forward(), recompute()
