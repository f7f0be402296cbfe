"""Partitioning layers over stages: each method on a model with uneven layers."""

from __future__ import annotations

import pytest
from torch import nn

from trident.pipeline import LayerSpec, PipelineModule, partition_balanced, partition_uniform
from trident.pipeline.partition import partition_layers


class Embed(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.table = nn.Embedding(n, 8)


class Wide(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d, bias=False)


class Norm(nn.LayerNorm):
    pass


def uneven_layers() -> list:
    """Parameters: 800, 64, 64, 256, 256, 1024, 16 (Norm: 8 weights + 8 biases)."""
    return [LayerSpec(Embed, 100), LayerSpec(Wide, 8), LayerSpec(Wide, 8), LayerSpec(Wide, 16),
            LayerSpec(Wide, 16), LayerSpec(Wide, 32), LayerSpec(Norm, 8)]


def test_uniform_gives_the_first_stages_the_extra_layers():
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    assert partition_uniform(8, 4) == [0, 2, 4, 6, 8]
    assert partition_uniform(3, 3) == [0, 1, 2, 3]


def test_balanced_minimises_the_heaviest_part_then_the_spread():
    # max 6 is optimal; 6 | 5 | 5 and 5 | 5 | 6 are more even than 6 | 4 | 6, and the tie
    # between them goes to the one with more layers early
    assert partition_balanced([5, 1, 1, 1, 1, 1, 1, 5], 3) == [0, 2, 7, 8]
    assert partition_balanced([1] * 10, 4) == partition_uniform(10, 4)
    assert partition_balanced([100, 10, 10, 10, 10, 10, 10, 100], 2) == [0, 4, 8]
    assert partition_balanced([1, 1, 1, 1], 4) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("method,stages,expected", [
    ("uniform", 2, [0, 4, 7]),
    ("uniform", 3, [0, 3, 5, 7]),
    # 800 + 64 + 64 + 256 = 1184 | 256 + 1024 + 16 = 1296 beats 1440 | 1040
    ("parameters", 2, [0, 4, 7]),
    ("parameters", 3, [0, 1, 5, 7]),
    ("type:wide", 2, [0, 4, 7]),     # 3 | 2 Wide layers (case-insensitive)
    ("type:^Wide$|Norm", 3, [0, 3, 5, 7]),
])
def test_module_partition_methods_on_uneven_layers(method, stages, expected):
    module = PipelineModule(uneven_layers(), num_stages=stages, partition_method=method, stage_id=0)
    assert module.parts == expected


def test_parameters_method_counts_what_each_stage_builds():
    module = PipelineModule(uneven_layers(), num_stages=2, partition_method="parameters", stage_id=1)
    assert sum(p.numel() for p in module.parameters()) == 256 + 1024 + 16
    text = module.describe_partition()
    assert "stage 0: layers 0-3 (Embed, Wide x3), 1,184 parameters" in text
    assert "stage 1: layers 4-6 (Wide x2, Norm), 1,296 parameters" in text


def test_partition_errors_name_the_problem():
    names = ["A", "B", "C"]
    with pytest.raises(ValueError, match="cannot split 3 layers into 4 pipeline parts"):
        partition_layers("uniform", 4, names)
    with pytest.raises(ValueError, match="matches none of the layer classes"):
        partition_layers("type:Block", 2, names)
    with pytest.raises(ValueError, match="not a valid regular expression"):
        partition_layers("type:(", 2, names)
    with pytest.raises(ValueError, match="unknown; use one of parameters, uniform, type:REGEX"):
        partition_layers("greedy", 2, names)
    with pytest.raises(ValueError, match="no parameters"):
        partition_layers("parameters", 2, names, [0, 0, 0])
