"""The training data loader: each dp rank reads only its samples, and its position survives
checkpoints, also across a change of the data-parallel size.

The data is one endless stream of samples (`BlendedDataset`, positions 0, 1, 2, ...). The loader
cuts it into *units* in an order that does not depend on the number of ranks:

    fixed batches   a unit is one sample; each micro-step the dp ranks together take the next
                    dp x micro positions, rank r the r-th group of `micro`
    token budget    (length bucketing) a unit is a batch: every window of `window` positions is
                    sorted by length and cut into batches of at most `max_tokens` padded tokens,
                    in a seeded order; each micro-step rank r takes the r-th next batch

The position, a cursor into that stream, is all the state: samples (fixed) or (window, batch)
(bucketing). `state_dict()` is the cursor after the last batch handed to the trainer, so a
checkpoint taken between steps resumes with exactly the batches that were next, at any dp size.
Worker processes read ahead; the cursor of every index list the sampler hands them is queued
and taken when that batch reaches the trainer, so prefetching never moves the saved position.

Ranks are placed by their dp coordinate only: the cp ranks of one replica read the same
full-length rows, and the model cuts each cp rank's sequence shard (`GPT.parallelize_context`),
so packed documents keep their global positions and document ids across the shards.
"""

from __future__ import annotations

import collections
from typing import Iterator

import numpy as np
import torch

from trident.data.blend import BlendedDataset
from trident.data.samples import IGNORE_INDEX


class FixedBatches:
    """`micro` consecutive positions per rank per micro-step; cursor = positions consumed."""

    kind = "fixed"

    def __init__(self, micro_batch_size: int, dp_rank: int, dp_size: int, cursor: int = 0):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, dp_size={dp_size})")
        self.micro, self.rank, self.dp, self.cursor = micro_batch_size, dp_rank, dp_size, cursor

    def batches(self) -> Iterator[tuple[list[int], int]]:
        """(this rank's positions, cursor after the micro-step) from `self.cursor` on."""
        cursor = self.cursor
        while True:
            start = cursor + self.rank * self.micro
            cursor += self.dp * self.micro
            yield list(range(start, start + self.micro)), cursor


class TokenBudgetBatches:
    """Length-bucketed batches of at most `max_tokens` padded tokens; cursor = (window, batch)."""

    kind = "bucketed"

    def __init__(self, dataset: BlendedDataset, max_tokens: int, dp_rank: int, dp_size: int, seed: int,
                 window: int = 4096, cursor: tuple[int, int] = (0, 0)):
        self.dataset, self.max_tokens, self.window, self.seed = dataset, max_tokens, window, seed
        self.rank, self.dp, self.cursor = dp_rank, dp_size, tuple(cursor)

    def window_batches(self, w: int) -> list[list[int]]:
        """The batches of window `w`: its positions sorted by length, cut by the token budget,
        in a seeded order (so lengths vary from step to step, not along the epoch)."""
        positions = np.arange(w * self.window, (w + 1) * self.window, dtype=np.int64)
        lengths = self.dataset.sample_lengths(positions)
        too_long = lengths > self.max_tokens
        if too_long.any():
            raise ValueError(f"a sample of {int(lengths.max())} tokens exceeds data.max_tokens_per_batch = "
                             f"{self.max_tokens}; raise it to at least data.seq_len")
        order = np.argsort(lengths, kind="stable")
        batches, current, longest = [], [], 0
        for i in order.tolist():
            n = int(lengths[i])
            if current and (len(current) + 1) * max(longest, n) > self.max_tokens:
                batches.append(current)
                current, longest = [], 0
            current.append(int(positions[i]))
            longest = max(longest, n)
        batches.append(current)
        shuffle = np.random.default_rng([self.seed, 1 << 20, w]).permutation(len(batches))
        return [batches[i] for i in shuffle.tolist()]

    def _stream(self) -> Iterator[tuple[list[int], tuple[int, int]]]:
        w, b = self.cursor
        batches = self.window_batches(w)
        while True:
            if b == len(batches):
                w, b = w + 1, 0
                batches = self.window_batches(w)
            b += 1
            yield batches[b - 1], (w, b)

    def batches(self) -> Iterator[tuple[list[int], tuple[int, int]]]:
        stream = self._stream()
        while True:
            group = [next(stream) for _ in range(self.dp)]
            yield group[self.rank][0], group[-1][1]


def collate(samples: list[dict]) -> dict[str, torch.Tensor | int]:
    """Stack samples; rows of different lengths are right-padded (labels -100, own document).

    Adds the ints `pad_tokens` (padding in the batch) and `tokens` (its input size) for the
    trainer's padding share, and `row_tokens`, each row's tokens before its padding (padding is
    always a row's tail), so a batch cut to a curriculum's length keeps exact counts.
    """
    lengths = [s["input_ids"].shape[0] for s in samples]
    length = max(lengths)
    row_tokens = [n - s.get("pad_tokens", 0) for n, s in zip(lengths, samples)]
    pad_tokens = length * len(samples) - sum(row_tokens)
    # counts as Python ints: a worker would send every 0-d tensor through its own shared memory
    out: dict[str, torch.Tensor | int | list[int]] = {"pad_tokens": pad_tokens, "tokens": length * len(samples),
                                                      "row_tokens": row_tokens}
    if min(lengths) == length:
        out.update({key: torch.stack([s[key] for s in samples]) for key in samples[0] if key != "pad_tokens"})
        return out
    for key in samples[0]:
        if key == "pad_tokens":
            continue
        rows = []
        for s in samples:
            t = s[key]
            extra = length - len(t)
            if extra:
                fill = {"labels": IGNORE_INDEX, "doc_ids": int(t.max()) + 1 if len(t) else 0}.get(key, 0)
                tail = torch.arange(extra) if key == "position_ids" else torch.full((extra,), fill, dtype=t.dtype)
                t = torch.cat([t, tail])
            rows.append(t)
        out[key] = torch.stack(rows)
    return out


class _RecordingSampler:
    """The batch sampler torch's DataLoader iterates (in the main process, ahead of delivery):
    hands out index lists and queues the cursor reached after each."""

    def __init__(self, units, cursors: collections.deque):
        self.units, self.cursors = units, cursors

    def __iter__(self) -> Iterator[list[int]]:
        for indices, cursor in self.units.batches():
            self.cursors.append(cursor)
            yield indices


class TridentDataLoader:
    """Endless iterator of this rank's micro-batches (dicts of tensors) with an exact position.

    `state_dict()` / `load_state_dict()` save and restore the position; `sampler` is the loader
    itself, so code that checkpoints `loader.sampler.state_dict()` (the engine's periodic
    checkpoints) records it too.
    """

    def __init__(self, dataset: BlendedDataset, units, num_workers: int = 0, prefetch_factor: int = 2,
                 pin_memory: bool | None = None):
        self.dataset, self.units = dataset, units
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._iterator = None

    @property
    def sampler(self) -> TridentDataLoader:
        return self

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        cursors: collections.deque = collections.deque()
        loader = torch.utils.data.DataLoader(
            self.dataset, batch_sampler=_RecordingSampler(self.units, cursors), collate_fn=collate,
            num_workers=self.num_workers, pin_memory=self.pin_memory,
            prefetch_factor=self.prefetch_factor if self.num_workers else None,
            persistent_workers=False)
        for batch in loader:
            self.units.cursor = cursors.popleft()
            yield batch

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._iterator is None:
            self._iterator = iter(self)
        return next(self._iterator)

    def close(self) -> None:
        """Stop the worker processes of the running iteration (a new one starts on `next`)."""
        if self._iterator is not None:
            self._iterator.close()
            self._iterator = None

    def state_dict(self) -> dict:
        """The position after the last batch handed out, and what must match to resume it."""
        cursor = self.units.cursor
        return {"kind": self.units.kind, "cursor": list(cursor) if isinstance(cursor, tuple) else cursor,
                "data": self.dataset.fingerprint(), "dp_size_when_saved": self.units.dp}

    def load_state_dict(self, state: dict) -> None:
        """Continue after the position in `state`; the dp size may differ from the saved one."""
        if state.get("kind") != self.units.kind:
            raise ValueError(f"the checkpoint's data position is of kind {state.get('kind')!r} (saved by "
                             f"{'the old DistributedSampler' if 'kind' not in state else 'another loader'}) but "
                             f"this loader batches by {self.units.kind!r}; resume with the same data.bucketing "
                             f"setting, or start the data from the beginning")
        if state["data"] != self.dataset.fingerprint():
            raise ValueError(f"the checkpoint's data position was taken on other data or settings:\n"
                             f"  saved: {state['data']}\n  now:   {self.dataset.fingerprint()}\n"
                             f"resuming would not continue with the samples that were next; use the same "
                             f"data.paths, weights, seq_len, packing and seed as the saved run")
        cursor = state["cursor"]
        self.close()
        self.units.cursor = tuple(cursor) if isinstance(cursor, list) else int(cursor)

