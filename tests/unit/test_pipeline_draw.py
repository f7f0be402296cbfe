"""Drawing timelines (text and PNG) and `trident pipeline show`."""

from __future__ import annotations

import argparse

from trident.cli import pipeline_cmd
from trident.pipeline import Costs, build_all, simulate
from trident.pipeline.draw import save_png, text_timeline


def test_text_timeline_of_gpipe():
    text = text_timeline(simulate(build_all("gpipe", 2, 2), Costs(forward=1.0, backward=2.0)))
    rows = text.splitlines()
    assert rows[0] == "stage 0  F0 F1 .........B0    B1    "
    assert rows[1] == "stage 1  ...F0 F1 B0    B1    ......"
    assert "stage 1: idle 33.3% of the makespan, up to 2 live micro-batch activations" in text


def test_png_is_written(tmp_path):
    out = save_png(simulate(build_all("zb_h1", 3, 4), Costs()), tmp_path / "zb.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="trident")
    pipeline_cmd.add_parser(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)


def test_pipeline_show(capsys, tmp_path):
    png = tmp_path / "t.png"
    assert _run(["pipeline", "show", "--stages", "2", "--micro-batches", "4", "--schedule",
                 "interleaved_1f1b", "--virtual-stages", "2", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("interleaved_1f1b: 2 stages x 2 chunk(s), 4 micro-batches; bubble 11.1%")
    assert "F0.1" in out and png.exists()


def test_pipeline_show_rejects_bad_combinations(capsys):
    assert _run(["pipeline", "show", "--stages", "2", "--micro-batches", "4", "--schedule", "1f1b",
                 "--virtual-stages", "2"]) == 1
    assert "needs schedule 'interleaved_1f1b'" in capsys.readouterr().err
    assert _run(["pipeline", "show", "--stages", "2", "--micro-batches", "4", "--schedule", "zb_h1",
                 "--backward", "1", "--backward-weight", "2"]) == 1
    assert "exceeds --backward" in capsys.readouterr().err
