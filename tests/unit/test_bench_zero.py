"""The ZeRO benchmark's bookkeeping: storage counting, medians over repeats, ratios, rotation.

The benchmark itself needs minutes and DeepSpeed; these parts decide what its table says.
"""

import importlib
from pathlib import Path

import pytest
import torch

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture()
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    return importlib.import_module("zero_vs_peers")


def test_storage_bytes_count_views_once_and_skip_meta_and_excluded(bench):
    flat = torch.zeros(100)
    other = torch.zeros(10, dtype=torch.float64)
    views = [flat[:50], flat[50:], flat.view(10, 10)]
    total, seen = bench.unique_storage_bytes(views + [other, torch.empty(5, device="meta"), None])
    assert total == 100 * 4 + 10 * 8
    rest, _ = bench.unique_storage_bytes([flat, other], exclude={flat.untyped_storage().data_ptr()})
    assert rest == 10 * 8
    assert seen == {flat.untyped_storage().data_ptr(), other.untyped_storage().data_ptr()}


def test_nested_tensors_walks_dicts_lists_and_tuples(bench):
    a, b, c = torch.ones(1), torch.ones(2), torch.ones(3)
    found = list(bench.nested_tensors({0: [a, (b,)], 1: {"x": c, "n": 3}}))
    assert [t.numel() for t in found] == [1, 2, 3]
    assert list(bench.nested_tensors(None)) == []


def test_summary_takes_slowest_rank_then_median_over_repeats(bench):
    repeats = [[(0.10, 5.0), (0.30, 1.0)], [(0.20, 2.0), (0.25, 9.0)], [(0.50, 3.0), (0.40, 4.0)]]
    small = {"parameters": 10, "gradients": 10, "optimizer_states": 10}
    large = {"parameters": 12, "gradients": 10, "optimizer_states": 10}
    r = bench.summarize(2, 3, "deepspeed", repeats, [(small, 100), (large, 90)], [7, 9])
    assert r.step_s == pytest.approx(0.30)   # slowest ranks 0.30, 0.25, 0.50
    assert r.faults == pytest.approx(5.0)    # largest per repeat 5, 9, 4
    assert r.states == large and r.state_bytes == 32
    assert r.live == 100 and r.rss == 9


def test_table_puts_trident_over_peer_ratios_on_peer_rows(bench):
    states = {"parameters": 2**20, "gradients": 2**20, "optimizer_states": 2 * 2**20}
    ours = bench.Result(2, 3, "trident", 0.2, 10, 100 * 2**20, states, 5 * 2**20)
    peer = bench.Result(2, 3, "fsdp2", 0.4, 20, 200 * 2**20, {k: 2 * v for k, v in states.items()}, 9 * 2**20)
    rows = bench.format_table([ours, peer]).splitlines()
    assert len(rows) == 4 and rows[2].startswith("| 2 | 3 | trident | 200.0 | 100.0 | 4.0 (1.0 + 1.0 + 2.0)")
    assert rows[3].endswith("| 0.500 | 0.500 | 0.500 |")
    assert rows[2].endswith("| | | |")


def test_rotation_puts_each_system_first_once(bench):
    systems = ["trident", "deepspeed", "fsdp2"]
    orders = [bench.rotated(systems, r) for r in range(3)]
    assert [o[0] for o in orders] == systems
    assert all(sorted(o) == sorted(systems) for o in orders)
