"""The layout search: only valid layouts, every GPU used, a stable ranking with reasons."""

from __future__ import annotations

import pytest

from trident.planner import Workload, layout_problems, make_cluster, model_preset, search
from trident.planner.search import SearchSpace

SMALL = SearchSpace(micro_batches=(1, 4), checkpointing=("none", "full"))


@pytest.fixture(scope="module")
def gpt2_on_16():
    """gpt2-124m (12 heads, 12 layers) on 16 V100s: tp 16 and pp 16 cannot divide it."""
    return search(model_preset("gpt2-124m"), make_cluster("v100-32gb", 16, 8), Workload(1024, 64), SMALL)


def test_search_proposes_only_valid_layouts(gpt2_on_16):
    model = model_preset("gpt2-124m")
    assert gpt2_on_16.ranked
    for c in gpt2_on_16.ranked + gpt2_on_16.too_big:
        lay = c.layout
        assert lay.dp * lay.tp * lay.pp == 16
        assert model.n_head % lay.tp == 0 and model.n_layer % lay.pp == 0
        assert not layout_problems(model, lay, Workload(1024, 64), 16)
        assert not (lay.zero_stage >= 2 and lay.pp > 1)
        assert lay.offload_params == "none" or lay.zero_stage == 3


def test_invalid_splits_are_reported_with_their_rule(gpt2_on_16):
    reasons = {(lay.tp, lay.pp): "; ".join(why) for lay, why in gpt2_on_16.invalid}
    assert "tp 16 does not divide the 12 attention heads" in reasons[(16, 1)]
    assert "pp 16 does not divide the 12 layers" in reasons[(1, 16)]
    assert "pp 8 does not divide the 12 layers" in reasons[(2, 8)]


def test_ranking_is_by_throughput_and_stable(gpt2_on_16):
    tput = [c.estimate.time.tokens_per_s for c in gpt2_on_16.ranked]
    assert tput == sorted(tput, reverse=True)
    again = search(model_preset("gpt2-124m"), make_cluster("v100-32gb", 16, 8), Workload(1024, 64), SMALL)
    assert [c.layout for c in again.ranked] == [c.layout for c in gpt2_on_16.ranked]
    keys = [c.sort_key() for c in gpt2_on_16.ranked]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)  # a total order: no ties left to chance


def test_every_place_is_explained(gpt2_on_16):
    assert all(c.reason.startswith("compute ") and "largest overhead" in c.reason for c in gpt2_on_16.ranked)
    text = gpt2_on_16.format(top=5)
    assert "layouts fit" in text and "invalid splits:" in text
    assert text.count("\n") > 5


def test_rejected_layouts_say_how_much_memory_they_need():
    result = search(model_preset("gpt3-13b"), make_cluster("v100-32gb", 4, 4), Workload(2048, 8),
                    SearchSpace(micro_batches=(1,), checkpointing=("full",), zero_stages=(0, 1),
                                offloads=(("none", "none"),)))
    assert not result.ranked  # 13B with Adam on 4 x 32 GB does not fit without ZeRO-2/3 or offload
    assert result.too_big and all(c.reason.startswith("needs ") and "GiB per GPU" in c.reason for c in result.too_big)
    assert "does not fit" in result.format()


def test_more_memory_per_gpu_never_fits_fewer_layouts():
    model, w = model_preset("gpt3-2.7b"), Workload(2048, 32)
    small = search(model, make_cluster("a100-40gb", 8, 8), w, SMALL)
    big = search(model, make_cluster("a100-80gb", 8, 8), w, SMALL)
    assert {c.layout for c in small.ranked} <= {c.layout for c in big.ranked}


def test_does_not_fit_columns_stay_apart():
    """A long layout (offload=cpu/cpu) keeps at least two spaces before its reason."""
    result = search(model_preset("gpt3-175b"), make_cluster("v100-32gb", 1, 1), Workload(2048, 8),
                    SearchSpace(micro_batches=(1,), checkpointing=("selective",), zero_stages=(3,),
                                offloads=(("cpu", "cpu"),)))
    rows = result.format().split("does not fit (")[1].splitlines()[1:]
    assert rows and all("  needs " in r for r in rows if "needs" in r)
    assert any("cpu/cpu" in r for r in rows) and not any("cpu/cpuneeds" in r for r in rows)
