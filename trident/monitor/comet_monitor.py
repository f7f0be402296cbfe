"""Comet (DeepSpeed's `comet` section): the engine's scalars into one Comet experiment.

`comet_ml.start(api_key, project, workspace, experiment_key, mode, online)` as DeepSpeed calls
it, on the writer rank only, and DeepSpeed's thinning: a metric is logged again only once
`samples_log_interval` more samples have passed (the events' step is global samples). With
`online` unset and no API key configured, the experiment is an offline one: an archive under
COMET_OFFLINE_DIRECTORY (default .cometml-runs) that `comet upload` sends later.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

from trident.monitor.log import logger

Event = tuple[str, float, int]


def comet_api_key(given: str | None) -> bool:
    """Whether Comet has an API key: the section's, COMET_API_KEY, or Comet's config files."""
    if given or os.environ.get("COMET_API_KEY"):
        return True
    try:
        from comet_ml.config import get_config
        return bool(get_config("comet.api_key"))
    except Exception:  # an older comet_ml without the helper: the environment said no
        return False


class CometMonitor:
    """One Comet experiment (`experiment`); `write_events` logs what DeepSpeed's thinning lets through."""

    def __init__(self, settings: Any, run_config: dict | None = None) -> None:
        import comet_ml

        online = settings.online
        if online is None and not comet_api_key(settings.api_key):
            online = False
            logger.info("comet: no Comet API key configured; logging to an offline archive under %s "
                        "(upload with `comet upload`)", os.environ.get("COMET_OFFLINE_DIRECTORY") or ".cometml-runs")
        self.samples_log_interval = settings.samples_log_interval
        self.experiment = comet_ml.start(api_key=settings.api_key, project=settings.project,
                                         workspace=settings.workspace, experiment_key=settings.experiment_key,
                                         mode=settings.mode, online=online)
        if settings.experiment_name is not None:
            self.experiment.set_name(settings.experiment_name)
        if run_config:
            self.experiment.log_parameters(run_config)
        self._last_logged: dict[str, int] = {}

    def needs_logging(self, name: str, samples: int) -> bool:
        """DeepSpeed's EventsLogScheduler: a metric's first event, then one per samples_log_interval."""
        last = self._last_logged.get(name)
        if last is None or samples - last >= self.samples_log_interval:
            self._last_logged[name] = samples
            return True
        return False

    def write_events(self, events: Iterable[Event]) -> None:
        for name, value, step in events:
            if self.needs_logging(name, int(step)):
                self.experiment.log_metric(name, float(value), step=int(step))

    def flush(self) -> None:
        """Comet sends (or, offline, writes) metrics from its own thread."""

    def close(self) -> None:
        if self.experiment is not None:
            self.experiment.end()
            self.experiment = None
