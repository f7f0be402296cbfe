"""MLflow (trident's `mlflow` section): the engine's scalars into one MLflow run.

Through `mlflow.MlflowClient` (in `mlflow-skinny` as in `mlflow`): the tracking URI is the
section's, else MLFLOW_TRACKING_URI, else the local file store `./mlruns` (a folder of plain
files, readable with `MlflowClient("file://.../mlruns").get_metric_history` or `mlflow ui`).
MLflow 3 keeps the file store behind MLFLOW_ALLOW_FILE_STORE; asking for a folder is asking for
it, so trident sets that variable (unless it is set) when the URI is a folder.
"""

from __future__ import annotations

import os
import time
from itertools import groupby
from pathlib import Path
from typing import Any, Iterable
from urllib.parse import urlparse

Event = tuple[str, float, int]


def tracking_uri(configured: str | None) -> str:
    """The section's URI, else MLFLOW_TRACKING_URI, else `file://<cwd>/mlruns`."""
    return configured or os.environ.get("MLFLOW_TRACKING_URI") or Path("mlruns").resolve().as_uri()


def is_file_store(uri: str) -> bool:
    scheme = urlparse(uri).scheme
    return scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt")  # a Windows drive letter


class MLflowMonitor:
    """One MLflow run (`run_id`, `tracking_uri`); `write_events` logs each step's events as one batch."""

    def __init__(self, settings: Any) -> None:
        from mlflow import MlflowClient

        self.tracking_uri = tracking_uri(settings.tracking_uri)
        if is_file_store(self.tracking_uri):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        name = settings.experiment_name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "Default"
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment is not None else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment_id, run_name=settings.run_name).info.run_id

    def write_events(self, events: Iterable[Event]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        for step, group in groupby(events, key=lambda e: int(e[2])):
            self.client.log_batch(self.run_id, metrics=[Metric(name, float(value), now, step)
                                                        for name, value, _ in group])

    def flush(self) -> None:
        """Each batch is written when logged."""

    def close(self) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id)
            self.run_id = None
