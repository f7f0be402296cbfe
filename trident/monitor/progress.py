"""The training progress bar: one line that redraws on a terminal, periodic lines in a log.

Only rank 0 draws (`enabled=False` elsewhere makes every call a no-op). When the stream is not a
terminal (CI logs, `> file`), a redrawing bar would write a carriage-return frame per step, so
the bar prints one compact line every `print_every` steps instead.
"""

from __future__ import annotations

import math
import sys
import time
from typing import IO, Mapping

from tqdm import tqdm

# (metric key the trainer passes, label shown, format)
_FIELDS = (
    ("loss", "loss", "{:.4f}"),
    ("tokens_per_s", "tok/s", "{:,.0f}"),
    ("loss_scale", "scale", "{:g}"),
    ("lr", "lr", "{:.2e}"),
    ("pad_share", "pad", "{:.1%}"),
)


def format_metrics(metrics: Mapping[str, float | None]) -> str:
    """'loss 3.2100 | tok/s 12,345 | scale 1 | lr 1.00e-03', skipping absent or NaN values."""
    parts = []
    for key, label, fmt in _FIELDS:
        value = metrics.get(key)
        if value is None or math.isnan(value):
            continue
        parts.append(f"{label} {fmt.format(value)}")
    return " | ".join(parts)


class ProgressBar:
    """Step counter with loss, tokens/s, loss scale and learning rate.

    `update(step, metrics)` is called once per optimizer step with the 1-based step number and a
    dict holding any of `loss`, `tokens_per_s`, `loss_scale`, `lr`, `pad_share`.
    """

    def __init__(self, total_steps: int, enabled: bool = True, stream: IO[str] | None = None,
                 print_every: int | None = None):
        self.total_steps = total_steps
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stdout
        self.print_every = print_every if print_every is not None else max(1, total_steps // 10)
        self._start = time.perf_counter()
        self._bar: tqdm | None = None
        if enabled and _is_tty(self.stream):
            self._bar = tqdm(total=total_steps, file=self.stream, dynamic_ncols=True,
                             unit="step", desc="train")

    def update(self, step: int, metrics: Mapping[str, float | None]) -> None:
        if not self.enabled:
            return
        text = format_metrics(metrics)
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.update(step - self._bar.n)
        elif step == 1 or step % self.print_every == 0 or step == self.total_steps:
            elapsed = time.perf_counter() - self._start
            width = len(str(self.total_steps))
            self.stream.write(f"step {step:>{width}}/{self.total_steps} | {text} | {elapsed:.1f} s\n")
            self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_tty(stream: IO[str]) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())
