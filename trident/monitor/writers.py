"""Metric writers with DeepSpeed's monitor interface: `write_events([(name, value, step), ...])`.

`CSVMonitor` keeps one table, `<output_path>/<job_name>/metrics.csv`, one row per step and one
column per metric (DeepSpeed writes one file per metric; a single table is easier to read and
to plot). `TensorBoardMonitor` writes event files into `<output_path>/<job_name>/`. The other
backends have a module each: `wandb_monitor`, `comet_monitor`, `mlflow_monitor`. `Monitors`
builds every enabled one from the config's sections (`tensorboard`, `csv_monitor`, `wandb`,
`comet`, `mlflow`) and fans events out. Only rank 0 writes: the caller passes `enabled=False`
on every other rank. docs/monitoring.md lists what is written when.
"""

from __future__ import annotations

import atexit
import csv
import importlib.util
import os
from itertools import groupby
from pathlib import Path
from typing import Any, Iterable

from trident.config.monitor_sections import MONITOR_SECTIONS, CometConfig, MLflowConfig, WandbConfig
from trident.config.run_sections import CSVMonitorConfig, TensorBoardConfig

Event = tuple[str, float, int]

# Each section's keys and DeepSpeed's defaults (deepspeed/monitor/config.py; mlflow is trident's).
SECTION_CLASSES = {"tensorboard": TensorBoardConfig, "csv_monitor": CSVMonitorConfig, "wandb": WandbConfig,
                   "comet": CometConfig, "mlflow": MLflowConfig}


class CSVMonitor:
    """`metrics.csv` with header `step,<metric>,...`; a row per step, cells empty where unset.

    A metric first seen after rows were written adds a column: the file is rewritten with the
    wider header and empty cells in the earlier rows. Events for a step already written are
    merged into its row. An existing file (a resumed run) is continued, not replaced.
    """

    def __init__(self, output_path: str, job_name: str, filename: str = "metrics.csv"):
        self.log_dir = Path(output_path) / job_name
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.log_dir / filename
        self.columns: list[str] = []
        self.rows: list[dict[str, str]] = []
        if self.path.is_file() and self.path.stat().st_size > 0:
            with open(self.path, newline="") as f:
                reader = csv.DictReader(f)
                self.columns = [c for c in reader.fieldnames or [] if c != "step"]
                self.rows = list(reader)

    def write_events(self, events: Iterable[Event]) -> None:
        rewrite = False
        appended: list[dict[str, str]] = []
        for step, group in groupby(events, key=lambda e: int(e[2])):
            values = {name: _format(value) for name, value, _ in group}
            new = [name for name in values if name not in self.columns]
            if new and self.rows:
                rewrite = True
            self.columns.extend(new)
            if self.rows and self.rows[-1]["step"] == str(step):
                self.rows[-1].update(values)
                rewrite = True
            else:
                row = {"step": str(step), **values}
                self.rows.append(row)
                appended.append(row)
        if rewrite or not self.path.is_file() or self.path.stat().st_size == 0:
            self._write(self.rows, mode="w")
        elif appended:
            self._write(appended, mode="a")

    def _write(self, rows: list[dict[str, str]], mode: str) -> None:
        with open(self.path, mode, newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["step", *self.columns], restval="")
            if mode == "w":
                writer.writeheader()
            writer.writerows(rows)

    def flush(self) -> None:
        """Rows are written as they arrive; nothing is buffered."""

    def close(self) -> None:
        """Nothing to release: the file is opened per write."""


class TensorBoardMonitor:
    """Scalars into a TensorBoard event file under `<output_path>/<job_name>/`."""

    def __init__(self, output_path: str, job_name: str, flush_secs: int = 10):
        # imported here: tensorboard costs a noticeable import time and only rank 0 needs it
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = os.path.join(output_path, job_name)
        os.makedirs(self.log_dir or ".", exist_ok=True)
        self.writer = SummaryWriter(log_dir=self.log_dir, flush_secs=flush_secs)

    def write_events(self, events: Iterable[Event]) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, float(value), int(step))

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MonitorLibraryMissing(ImportError):
    """An enabled monitor section whose library is not installed; the message names the pip package."""


LIBRARIES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
    "comet": ("comet_ml", "comet_ml"), "mlflow": ("mlflow", "mlflow-skinny"),
}
"""Section -> (the module it imports, the pip package that installs it)."""


def require_library(key: str) -> None:
    """Raise `MonitorLibraryMissing` when section `key`'s library is not installed (checked
    without importing it, so every rank can ask cheaply and all fail alike)."""
    if key not in LIBRARIES:
        return
    module, package = LIBRARIES[key]
    if importlib.util.find_spec(module) is None:
        raise MonitorLibraryMissing(
            f"{key}.enabled is true, but the Python package `{package}` (module `{module}`) is not installed: "
            f"pip install {package}  (or pip install 'trident[monitors]' for every monitor), or set "
            f"{key}.enabled to false")


class Monitors:
    """Every enabled monitor of the config behind one `write_events` / `flush` / `close`:
    DeepSpeed's MonitorMaster, one writer per backend.

    The sections are `tensorboard`, `csv_monitor` (keys `enabled`, `output_path`, `job_name`,
    DeepSpeed's defaults False, "", "DeepSpeedJobName"), `wandb`, `comet` and `mlflow`, as typed
    config sections or plain dicts. Every rank checks that the enabled sections' libraries are
    installed (the same error everywhere, naming the pip package); only a rank with
    `enabled=True` (the writer) creates the writers. `run_config` (the resolved config) is given
    to the backends that record a run's parameters (wandb, comet). `writers` adds writers of
    one's own (anything with `write_events`, `flush` and `close`).
    """

    def __init__(self, tensorboard: Any = None, csv_monitor: Any = None, enabled: bool = True, *,
                 wandb: Any = None, comet: Any = None, mlflow: Any = None, run_config: dict | None = None,
                 writers: Iterable[Any] = ()) -> None:
        given = {"tensorboard": tensorboard, "csv_monitor": csv_monitor, "wandb": wandb, "comet": comet,
                 "mlflow": mlflow}
        on = {key: settings for key, settings in ((k, _section(k, given[k])) for k in MONITOR_SECTIONS)
              if settings.enabled}
        for key in on:
            require_library(key)
        self.writers: list[Any] = list(writers)
        if enabled:
            for key, settings in on.items():
                self.writers.append(_build(key, settings, run_config))
        if self.writers:
            atexit.register(self.close)  # a script that never calls engine.destroy() still closes its runs

    @classmethod
    def from_config(cls, cfg: Any, enabled: bool) -> Monitors:
        """The monitors of a whole config (a TridentConfig); `enabled` on the writer rank only."""
        return cls(**{key: getattr(cfg, key) for key in MONITOR_SECTIONS}, enabled=enabled,
                   run_config=_without_secrets(cfg.to_dict()) if hasattr(cfg, "to_dict") else None)

    @property
    def enabled(self) -> bool:
        return bool(self.writers)

    def write_events(self, events: list[Event]) -> None:
        for writer in self.writers:
            writer.write_events(events)

    def flush(self) -> None:
        for writer in self.writers:
            writer.flush()

    def close(self) -> None:
        """Close every writer (finishes W&B / MLflow runs, ends a Comet experiment); idempotent."""
        writers, self.writers = self.writers, []
        for writer in writers:
            writer.close()


MonitorMaster = Monitors
"""DeepSpeed's name of the fan-out."""


def _build(key: str, settings: Any, run_config: dict | None) -> Any:
    if key == "tensorboard":
        return TensorBoardMonitor(settings.output_path, settings.job_name)
    if key == "csv_monitor":
        return CSVMonitor(settings.output_path, settings.job_name)
    if key == "wandb":
        from trident.monitor.wandb_monitor import WandbMonitor
        return WandbMonitor(settings, run_config)
    if key == "comet":
        from trident.monitor.comet_monitor import CometMonitor
        return CometMonitor(settings, run_config)
    from trident.monitor.mlflow_monitor import MLflowMonitor
    return MLflowMonitor(settings)


def _without_secrets(config: Any) -> Any:
    """The config a run records as its parameters, with API keys (comet.api_key) left out."""
    if isinstance(config, dict):
        return {k: _without_secrets(v) for k, v in config.items() if k != "api_key"}
    return config


def _section(key: str, section: Any) -> Any:
    """Section `key` as its typed config class, from a typed object, a dict, or None (all defaults)."""
    kind = SECTION_CLASSES[key]
    if section is None:
        return kind()
    if isinstance(section, kind):
        return section
    if isinstance(section, dict):
        unknown = sorted(set(section) - set(kind.model_fields))
        if unknown:
            raise ValueError(f"{key}: unknown key(s) {', '.join(unknown)}; allowed keys are "
                             f"{', '.join(kind.model_fields)}")
        return kind(**section)
    return kind(**{name: getattr(section, name) for name in kind.model_fields if hasattr(section, name)})


def _format(value: float) -> str:
    """repr of the float: reading the cell back with float() gives the same number."""
    return repr(float(value))
