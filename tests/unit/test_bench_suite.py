"""bench/suite.py's verdict: medians, ratios, targets, unavailable rows, and the files it writes.

Nothing is timed here: the samples are made up, so every figure in the table is known.
"""

import importlib
import json
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture()
def report(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    return importlib.import_module("suite_report")


@pytest.fixture()
def specs(report):
    return [report.RowSpec("ZeRO-3", "z3", "DDP", "ddp", 1.10),
            report.RowSpec("DP", "dp", "DDP", "ddp", 1.00),
            report.RowSpec("ZeRO-3", "z3", "DeepSpeed ZeRO-3", "ds3", 1.00),
            report.RowSpec("compile", "compiled", "eager", "dp", 1 / 1.2, "<= 0.833 (>= 1.2x faster)")]


SAMPLES = {"ddp": [0.200, 0.100, 0.300, 0.250, 0.150],    # median 0.200
           "z3": [0.210, 0.900, 0.220, 0.215, 0.100],     # median 0.215 -> 1.075 of DDP
           "dp": [0.201, 0.202, 0.203],                   # median 0.202 -> 1.01 of DDP
           "compiled": [0.160, 0.170]}                    # median 0.165 -> 0.817 of dp


def test_rows_take_medians_and_judge_each_ratio_against_its_own_target(report, specs):
    rows = report.summarize(specs, SAMPLES, {"ds3": "deepspeed is not importable"})
    z3, dp, ds3, comp = rows
    assert z3["trident_ms"] == pytest.approx(215.0) and z3["peer_ms"] == pytest.approx(200.0)
    assert z3["ratio"] == pytest.approx(1.075) and z3["passed"] is True and z3["repeats"] == 5
    assert dp["ratio"] == pytest.approx(1.01) and dp["passed"] is False and dp["repeats"] == 3
    assert comp["ratio"] == pytest.approx(0.165 / 0.202) and comp["passed"] is True
    assert ds3["passed"] is None and ds3["ratio"] is None
    assert ds3["note"] == "not available: ds3: deepspeed is not importable"


def test_a_system_without_samples_is_not_available_rather_than_a_crash(report, specs):
    rows = report.summarize(specs[:1], {"z3": SAMPLES["z3"], "ddp": []}, {})
    assert rows[0]["passed"] is None and rows[0]["note"] == "not available: ddp: no sample"


def test_markdown_lists_every_row_with_its_verdict_and_a_count(report, specs):
    rows = report.summarize(specs, SAMPLES, {"ds3": "deepspeed is not importable"})
    text = report.markdown(rows, "measured somehow")
    lines = text.splitlines()
    assert lines[0] == "measured somehow"
    assert "| ZeRO-3 | DDP | 215.0 | 200.0 | 1.075 | 5 | <= 1.10 | pass |" in lines
    assert "| DP | DDP | 202.0 | 200.0 | 1.010 | 3 | <= 1.00 | FAIL |" in lines
    assert ("| ZeRO-3 | DeepSpeed ZeRO-3 |  |  |  | 0 | <= 1.00 | "
            "not available: ds3: deepspeed is not importable |") in lines
    assert "| compile | eager | 165.0 | 202.0 | 0.817 | 2 | <= 0.833 (>= 1.2x faster) | pass |" in lines
    assert lines[-1] == "2 of 3 measured rows meet their target; 1 not available."


def test_json_holds_rows_failures_and_every_sample_in_ms(report, specs, tmp_path):
    rows = report.summarize(specs, SAMPLES, {"ds3": "why"})
    path = tmp_path / "suite.json"
    report.write_json(path, rows, {"repeats": 5}, SAMPLES, {"ds3": "why"})
    data = json.loads(path.read_text())
    assert data["meta"] == {"repeats": 5} and data["failures"] == {"ds3": "why"}
    assert data["samples_ms"]["ddp"] == [200.0, 100.0, 300.0, 250.0, 150.0]
    assert [r["passed"] for r in data["rows"]] == [True, False, None, True]


def test_plot_writes_a_png_with_one_bar_per_row(report, specs, tmp_path, monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = report.summarize(specs, SAMPLES, {"ds3": "why"})
    seen = {}
    original = plt.Axes.barh

    def spy(ax, y, width, **kw):
        seen["bars"] = list(width)
        return original(ax, y, width, **kw)
    monkeypatch.setattr(plt.Axes, "barh", spy)
    report.plot(rows, tmp_path / "suite.png", "title")
    assert (tmp_path / "suite.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert seen["bars"] == pytest.approx([1.075, 1.01, 0.0, 0.165 / 0.202])


def test_suite_rows_name_known_systems_and_carry_the_issue_targets(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    suite = importlib.import_module("suite")
    for row in suite.ROWS:
        assert row.ours in suite.SYSTEMS and row.peer in suite.SYSTEMS
    targets = {(r.strategy, r.peer_label): r.target for r in suite.ROWS}
    assert targets[("DP (ZeRO stage 0), GPT 3.7M", "DDP")] == 1.00
    assert targets[("ZeRO-1", "DDP")] == targets[("ZeRO-2", "DDP")] == 1.05
    assert targets[("ZeRO-3", "DDP")] == targets[("ZeRO-3, demo GPT", "DDP")] == 1.10
    assert targets[("compile, demo GPT (demo.json, DP)", "eager")] == pytest.approx(1 / 1.2)
    peers = [r for r in suite.ROWS if r.peer_label != "DDP" and not r.strategy.startswith("compile")]
    assert peers and all(r.target == 1.00 for r in peers)
    rows, names = suite.selected(["zero-3"])
    assert {r.peer_label for r in rows} == {"DDP", "DeepSpeed ZeRO-3", "FSDP2"}
    assert names == ["trident-3", "ddp", "deepspeed-3", "fsdp2", "demo-trident-3", "demo-ddp"]
    with pytest.raises(SystemExit, match="matches no row"):
        suite.selected(["no such row"])
