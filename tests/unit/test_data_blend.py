"""BlendedDataset: exact proportions at every prefix, seeded order, a new order every epoch."""

from __future__ import annotations

import numpy as np
import pytest

from trident.data.blend import BlendedDataset, blend_order


class Numbers:
    """A dataset whose item i is (name, i)."""

    def __init__(self, name: str, n: int):
        self.name, self.n = name, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.name, i

    def fingerprint(self) -> str:
        return f"{self.name}:{self.n}"

    def sample_lengths(self, indices):
        return np.asarray(indices) + 1


@pytest.mark.parametrize("weights", [[0.5, 0.5], [0.7, 0.2, 0.1], [3, 1], [1, 1, 1, 1, 1, 1, 1],
                                     [0.001, 0.999], [0.3, 0.0, 0.7], list(np.random.default_rng(0).random(9))])
def test_proportions_within_one_sample_at_every_prefix(weights):
    w = np.asarray(weights, dtype=float) / np.sum(weights)
    n = 5000
    dataset, ordinal = blend_order(w, n)
    counts = np.zeros((n, len(w)))
    counts[np.arange(n), dataset] = 1
    counts = counts.cumsum(axis=0)
    ideal = np.outer(np.arange(1, n + 1), w)
    assert np.abs(counts - ideal).max() <= 1.0
    # each draw's ordinal is the number of earlier draws from the same dataset
    for d in range(len(w)):
        assert ordinal[dataset == d].tolist() == list(range(int((dataset == d).sum())))


def test_the_stream_keeps_proportions_past_the_epoch_and_samples_each_item_once_per_pass():
    blend = BlendedDataset([2, 1], [Numbers("a", 40), Numbers("b", 7)], size=30, seed=3)
    draws = [blend[i] for i in range(300)]
    a = [i for name, i in draws if name == "a"]
    b = [i for name, i in draws if name == "b"]
    assert len(a) == 200 and len(b) == 100  # 2:1, and the 30-position epoch divides evenly
    for items, n in ((a, 40), (b, 7)):
        for start in range(0, len(items) - n + 1, n):  # every pass is a permutation of the dataset
            assert sorted(items[start:start + n]) == list(range(n))


def test_same_seed_same_order_new_order_every_epoch():
    def stream(seed):
        blend = BlendedDataset([0.6, 0.4], [Numbers("a", 50), Numbers("b", 50)], seed=seed)
        return [blend[i] for i in range(300)]

    first, again, other = stream(1), stream(1), stream(2)
    assert first == again
    assert first != other
    epochs = [first[0:100], first[100:200], first[200:300]]
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    # the dataset choices repeat per epoch; what changes is which item each draw is
    assert [name for name, _ in epochs[0]] == [name for name, _ in epochs[1]]


def test_unshuffled_blend_reads_in_order_and_zero_weight_is_never_drawn():
    blend = BlendedDataset([1, 0], [Numbers("a", 5), Numbers("b", 5)], shuffle=False)
    assert [blend[i] for i in range(7)] == [("a", i % 5) for i in range(7)]
    with pytest.raises(ValueError, match="dataset b has no samples but blend weight"):
        BlendedDataset([1, 1], [Numbers("a", 5), Numbers("b", 0)], names=["a", "b"])
