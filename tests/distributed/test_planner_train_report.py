"""`trident train`'s step-time line: the planner's prediction for the run next to its measured
median, from the cluster file (or a clear note that there is none)."""

from __future__ import annotations

import torch

import trident
from trident.models.gpt import GPT, GPTConfig
from trident.tools.planner_check import step_time_report
from trident.planner.cluster import save_calibration
from trident.testing.distributed import cached_mesh, run_on_ranks
from tests.unit.test_planner_calibrated import _calibration

SHAPE = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)


def report(path: str) -> tuple[str, str]:
    torch.manual_seed(0)
    engine, *_ = trident.initialize(model=GPT(SHAPE), mesh=cached_mesh(), config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 0, "optimizer": {"type": "AdamW", "params": {}},
        "zero_optimization": {"stage": 1}})
    return (step_time_report(engine, SHAPE, [0.5, 0.2, 0.3, 0.25], path),
            step_time_report(engine, SHAPE, [0.5, 0.2], path + ".missing"))


def test_train_reports_predicted_next_to_measured_step_time(tmp_path):
    path = str(save_calibration(_calibration(), tmp_path / "cluster.json"))
    line, missing = run_on_ranks(2, report, path)[0]
    assert "measured median 0.250 s over steps 2-4, planner" in line and "predicted / measured" in line
    assert path in line
    assert "measured median 0.200 s; no prediction (no cluster file at" in missing and "--calibrate" in missing
