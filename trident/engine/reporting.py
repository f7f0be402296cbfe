"""What the engine reports after each optimizer step: events for the monitors and the log line.

Every step, on the writer rank, DeepSpeed's events (x-axis: global samples): `Train/Samples/
train_loss`, `lr`, `loss_scale` (fp16), the curriculum's `curriculum_seqlen` when one runs, the
MoE layers' load. Every `steps_per_print` steps also the rest of the scalars the log line
prints, measured over the steps since the last print: `grad_norm`, `samples_per_sec`,
`tokens_per_sec` (when the inputs hold token ids), and `memory_GiB` / `peak_memory_GiB` (the
accelerator's allocated bytes, or the process's resident memory on CPU). Each monitor (CSV,
TensorBoard, W&B, Comet, MLflow) gets the same events.
"""

from __future__ import annotations

import resource
import time
from typing import Any

import torch

from trident.moe.parallel import moe_events, moe_summary
from trident.monitor.log import logger

GiB = float(2 ** 30)
SEQUENCE_INPUTS = ("input_ids", "idx")
"""Keyword names under which a forward's token ids arrive (else: its first 2-D integer argument)."""


def token_ids(inputs: tuple, kwargs: dict) -> torch.Tensor | None:
    """The forward's token-id tensor (batch x sequence), if it has one."""
    for name in SEQUENCE_INPUTS:
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor) and value.dim() == 2:
            return value
    for value in inputs:
        if isinstance(value, torch.Tensor) and value.dim() == 2 and not value.is_floating_point():
            return value
    return None


def memory_bytes(device: torch.device) -> tuple[float, float]:
    """(now, peak) bytes: allocated on an accelerator; resident memory of the process on CPU."""
    if device.type == "cuda":
        return float(torch.cuda.memory_allocated(device)), float(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0  # KiB on Linux
    try:
        with open("/proc/self/statm") as f:
            now = int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        now = peak
    return float(now), peak


class StepReporter:
    """Counts what the forwards saw between two prints and writes each step's report."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._start: float | None = None  # the window opens at its first forward (or the first report)
        self._samples_at_start = 0
        self._tokens = 0
        self._rows = 0

    def count_inputs(self, inputs: tuple, kwargs: dict) -> None:
        """Note a forward's batch: its rows and token ids (shapes only; no device sync)."""
        if self._start is None:
            self._start = time.perf_counter()
        ids = token_ids(inputs, kwargs)
        if ids is not None:
            self._rows += ids.shape[0]
            self._tokens += ids.numel()

    def report(self, engine: Any) -> None:
        step, samples = engine.global_steps, engine.global_samples
        every = engine.config.steps_per_print
        printing = bool(every) and step % every == 0
        monitors = engine.monitors
        if monitors is not None and getattr(monitors, "enabled", True) and engine.ranks.writer:
            events = [("Train/Samples/train_loss", engine.last_loss, samples),
                      ("Train/Samples/lr", engine.get_lr()[0], samples)]
            if engine.loss_scaler is not None:
                events.append(("Train/Samples/loss_scale", engine.loss_scale, samples))
            if engine.curriculum_scheduler_legacy is not None:
                events.append(("Train/Samples/curriculum_seqlen",
                               engine.curriculum_scheduler_legacy.get_current_difficulty(), samples))
            events += moe_events(engine.module, samples)  # MoE: expert load, dropped share
            if printing:
                events += self._interval_events(engine, samples)
            monitors.write_events(events)
            monitors.flush()  # as DeepSpeed's monitors do: a killed job keeps its curves
        if printing:
            norm = engine.get_global_grad_norm()
            logger.info("step %d: loss %.4f, lr %.3e, loss scale %g, grad norm %s, skipped %d",
                        step, engine.last_loss, engine.get_lr()[0], engine.loss_scale,
                        "n/a" if norm is None else f"{norm:.4f}", engine.skipped_steps)
            if engine.timers.enabled:
                logger.info("step %d time: %s", step, engine.timers.report_and_reset())
            for line in moe_summary(engine.module):
                logger.info("step %d: %s", step, line)
            self._start, self._samples_at_start, self._tokens, self._rows = time.perf_counter(), samples, 0, 0
        elif self._start is None:
            self._start = time.perf_counter()

    def _interval_events(self, engine: Any, samples: int) -> list[tuple[str, float, int]]:
        events = []
        norm = engine.get_global_grad_norm()
        if norm is not None:
            events.append(("Train/Samples/grad_norm", norm, samples))
        elapsed = time.perf_counter() - self._start if self._start is not None else 0.0
        done = samples - self._samples_at_start
        if elapsed > 0 and done > 0:
            events.append(("Train/Samples/samples_per_sec", done / elapsed, samples))
            if self._rows:
                events.append(("Train/Samples/tokens_per_sec", done * self._tokens / self._rows / elapsed, samples))
        now, peak = memory_bytes(self.device)
        events += [("Train/Samples/memory_GiB", now / GiB, samples), ("Train/Samples/peak_memory_GiB", peak / GiB,
                                                                        samples)]
        return events
