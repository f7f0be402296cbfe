"""`trident train` with DeepSpeed's legacy `curriculum_learning` and the wandb / MLflow monitors:
each step trains on DeepSpeed's sequence length for it (metrics.csv's `seq_len`, the batches'
token counts), the MLflow run (local file store) and the offline wandb run hold the engine's
scalars, and an automatic resume continues the schedule at the saved step."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.scripts.jobs import train_and_read_metrics
from tests.unit.test_curriculum import deepspeed_run

pytestmark = pytest.mark.launch

CURRICULUM = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 16, "max_difficulty": 64,
              "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 5, "difficulty_step": 16}}
STEPS = 6


def _train(tmp_path: Path, steps: int, name: str) -> list[dict]:
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "model": {"type": "gpt", "preset": "tiny"}, "data": {"dataset": "kjv"},
              "trainer": {"train_steps": steps, "save_interval": 0},
              "checkpoint": {"path": str(tmp_path / "ckpt"), "save_interval": 3, "auto_resume": True},
              "curriculum_learning": CURRICULUM,
              "wandb": {"enabled": True, "project": "curriculum"},
              "mlflow": {"enabled": True, "tracking_uri": str(tmp_path / "mlruns"), "run_name": name}}
    return train_and_read_metrics(tmp_path, config, name)


def test_train_follows_the_schedule_logs_it_and_resumes_it(tmp_path, monkeypatch):
    import wandb  # noqa: F401  (the dev extra installs it: missing is a failure, not a skip)
    import mlflow  # noqa: F401  (the dev extra installs it: missing is a failure, not a skip)
    from mlflow import MlflowClient

    for name, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
                        "WANDB_ERROR_REPORTING": "false", "MLFLOW_ALLOW_FILE_STORE": "true"}.items():
        monkeypatch.setenv(name, value)
    expected = deepspeed_run(CURRICULUM, STEPS)
    assert expected == [16, 32, 32, 48, 64, 64]
    first = _train(tmp_path, 3, "first")
    assert [int(r["step"]) for r in first] == [1, 2, 3]
    assert [int(float(r["seq_len"])) for r in first] == expected[:3]
    assert all(float(r["tokens_per_s"]) > 0 for r in first)

    resumed = _train(tmp_path, STEPS, "resumed")  # auto_resume: the checkpoint of step 3
    assert [int(r["step"]) for r in resumed] == [4, 5, 6]
    assert [int(float(r["seq_len"])) for r in resumed] == expected[3:]

    client = MlflowClient((tmp_path / "mlruns").as_uri())
    runs = {r.info.run_name: r.info.run_id for r in client.search_runs(["0"])}
    for name, steps in (("first", range(0, 3)), ("resumed", range(3, STEPS))):
        history = client.get_metric_history(runs[name], "Train/Samples/curriculum_seqlen")
        assert [int(m.value) for m in history] == [expected[s] for s in steps]
    loss = client.get_metric_history(runs["resumed"], "Train/Samples/train_loss")
    assert [m.step for m in loss] == [4 * s for s in range(4, STEPS + 1)]  # global samples: 2 x 2 ranks a step
    assert len(list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))) == 2  # rank 0's run of each launch
