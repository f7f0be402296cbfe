"""Weights & Biases (DeepSpeed's `wandb` section): the engine's scalars into one W&B run.

`wandb.init(project, group, entity=team)` as DeepSpeed calls it, on the writer rank only; the
x-axis is the event's step (DeepSpeed's: global samples). With no W&B credentials to be found
(WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, a netrc entry for the W&B host) and no WANDB_MODE,
the run is logged offline under `$WANDB_DIR/wandb/offline-run-*` (`wandb sync` uploads it later),
so a job on a machine without network or login still keeps its curves.
"""

from __future__ import annotations

import netrc
import os
from itertools import groupby
from typing import Any, Iterable
from urllib.parse import urlparse

from trident.monitor.log import logger

Event = tuple[str, float, int]


def wandb_credentials() -> bool:
    """Whether wandb can log in without asking: an API key or token file in the environment,
    or a netrc entry for the W&B host (WANDB_BASE_URL, else api.wandb.ai)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbMonitor:
    """One W&B run; `write_events` logs each step's events as one row at that step."""

    def __init__(self, settings: Any, run_config: dict | None = None) -> None:
        import wandb

        mode = None
        if not os.environ.get("WANDB_MODE") and not wandb_credentials():
            mode = "offline"
            logger.info("wandb: no W&B credentials found (WANDB_API_KEY, netrc); logging offline under %s "
                        "(upload with `wandb sync`)", os.path.join(os.environ.get("WANDB_DIR") or ".", "wandb"))
        self.run = wandb.init(project=settings.project, group=settings.group, entity=settings.team, mode=mode,
                              config=run_config, reinit="create_new")

    def write_events(self, events: Iterable[Event]) -> None:
        for step, group in groupby(events, key=lambda e: int(e[2])):
            self.run.log({name: float(value) for name, value, _ in group}, step=step)

    def flush(self) -> None:
        """wandb streams rows to its own process as they are logged."""

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
