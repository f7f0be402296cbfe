"""Several datasets drawn in fixed proportions, each reshuffled every time it is exhausted.

`BlendedDataset(weights, datasets)` is an endless stream of samples: position i (any i >= 0)
names one sample. Within every blend epoch of `size` positions the choice of dataset is
Megatron-LM's greedy: position i goes to the dataset whose count lags its share w_d * (i + 1)
the most, so after every prefix of n positions each dataset has round(w_d * n) samples within
one. Dataset d's k-th draw is sample perm_d,e[k mod len_d] with e = k div len_d, where
perm_d,e is a permutation seeded by (seed, d, e): a dataset repeats only after all its samples
were drawn, and in a new order each time. One dataset with weight 1 is the plain shuffled
stream with a new order every epoch.
"""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Sequence

import numpy as np
import torch


def _validate_weights(weights: Sequence[float], names: Sequence[str]) -> np.ndarray:
    w = np.asarray(list(weights), dtype=np.float64)
    if len(w) != len(names):
        raise ValueError(f"{len(w)} weights for {len(names)} datasets ({', '.join(names)}); give one weight per "
                         f"dataset")
    total = float(w.sum()) if len(w) else 0.0
    if not len(w) or not np.all(np.isfinite(w)) or (w < 0).any() or not total > 0:
        raise ValueError(f"blend weights {list(weights)} for {', '.join(names) or 'no datasets'} must be finite, "
                         f"non-negative and sum to a positive number (they sum to {total}); they are "
                         f"normalised, so e.g. [3, 1] draws 75% from the first")
    return w / total


def blend_order(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset of each position, its ordinal within that dataset) for `size` positions.

    Greedy largest deficit: after n positions dataset d has been drawn within one of w_d * n.
    """
    k = len(weights)
    dataset = np.empty(size, dtype=np.int16)
    ordinal = np.empty(size, dtype=np.int64)
    counts = [0] * k
    w = weights.tolist()
    for i in range(size):
        n = i + 1
        best, best_gap = 0, -math.inf
        for d in range(k):
            gap = w[d] * n - counts[d]
            if gap > best_gap:
                best, best_gap = d, gap
        dataset[i] = best
        ordinal[i] = counts[best]
        counts[best] += 1
    return dataset, ordinal


def _cached_blend_order(weights: np.ndarray, size: int, cache_dir: str | Path | None) -> tuple[np.ndarray, np.ndarray]:
    """`blend_order`, stored in `cache_dir` (it depends only on the weights and the size): the
    greedy is a Python loop, seconds for tens of millions of positions, so every rank and every
    later run loads it instead."""
    if cache_dir is None or len(weights) == 1:
        return blend_order(weights, size)
    key = hashlib.sha256(f"{weights.tolist()}|{size}".encode()).hexdigest()[:16]
    file = Path(cache_dir) / f"blend-{key}.npz"
    if file.is_file():
        with np.load(file) as data:
            return data["dataset"], data["ordinal"]
    dataset, ordinal = blend_order(weights, size)
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=file.parent, suffix=".npz.tmp")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, dataset=dataset, ordinal=ordinal)
        os.replace(tmp, file)
    except OSError:
        pass  # an unwritable cache only costs the next run the same loop
    return dataset, ordinal


class BlendedDataset(torch.utils.data.Dataset):
    """Draw from `datasets` in proportion to `weights`; item i for any i >= 0 (see module doc).

    `size` is the blend epoch (default: the datasets' total length); `len()` returns it, but any
    later position is valid and continues the stream. `shuffle=False` keeps each dataset in order.
    `cache_dir` keeps the blend order on disk for the next rank and run.
    """

    def __init__(self, weights: Sequence[float], datasets: Sequence, size: int | None = None, seed: int = 0,
                 shuffle: bool = True, names: Sequence[str] | None = None, cache_dir: str | Path | None = None):
        names = list(names) if names is not None else [getattr(getattr(d, "corpus", None), "name", f"dataset {i}")
                                                      for i, d in enumerate(datasets)]
        self.weights = _validate_weights(weights, names)
        self.datasets = list(datasets)
        self.lengths = np.array([len(d) for d in self.datasets], dtype=np.int64)
        for name, n, w in zip(names, self.lengths, self.weights):
            if n == 0 and w > 0:
                raise ValueError(f"dataset {name} has no samples but blend weight {w:g}; give it weight 0 or "
                                 f"remove it")
        self.size = int(size) if size is not None else int(self.lengths.sum())
        if self.size < 1:
            raise ValueError(f"blend size {self.size} must be at least 1")
        self.seed, self.shuffle = seed, shuffle
        self.dataset_index, self.dataset_ordinal = _cached_blend_order(self.weights, self.size, cache_dir)
        self.per_epoch = np.bincount(self.dataset_index, minlength=len(self.datasets)).astype(np.int64)
        self._perms: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return self.size

    def fingerprint(self) -> str:
        parts = [getattr(d, "fingerprint", lambda: str(len(d)))() for d in self.datasets]
        return f"blend:{self.weights.tolist()}:{self.size}:{self.seed}:{self.shuffle}:{parts}"

    def _permutation(self, d: int, epoch: int) -> np.ndarray:
        key = (d, epoch)
        perm = self._perms.get(key)
        if perm is None:
            perm = np.random.default_rng([self.seed, d, epoch]).permutation(int(self.lengths[d]))
            self._perms[key] = perm
            if len(self._perms) > 2 * len(self.datasets):
                self._perms.popitem(last=False)
        return perm

    def locate(self, position: int) -> tuple[int, int]:
        """(dataset, sample index in it) drawn at stream `position`."""
        if position < 0:
            raise IndexError(f"blend position {position} is negative")
        epoch, j = divmod(position, self.size)
        d = int(self.dataset_index[j])
        draw = epoch * int(self.per_epoch[d]) + int(self.dataset_ordinal[j])
        pass_, k = divmod(draw, int(self.lengths[d]))
        return d, int(self._permutation(d, pass_)[k]) if self.shuffle else k

    def sample_lengths(self, positions: np.ndarray) -> np.ndarray:
        """Input tokens of the samples at `positions` (for length bucketing)."""
        out = np.empty(len(positions), dtype=np.int64)
        located = [self.locate(int(p)) for p in positions]
        for d in range(len(self.datasets)):
            rows = [i for i, (dd, _) in enumerate(located) if dd == d]
            if rows:
                out[rows] = self.datasets[d].sample_lengths(np.array([located[i][1] for i in rows]))
        return out

    def __getitem__(self, position: int):
        d, k = self.locate(int(position))
        return self.datasets[d][k]
