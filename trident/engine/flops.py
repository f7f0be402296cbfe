"""The `flops_profiler` section in the training engine: DeepSpeed's report for one optimizer step.

Step `profile_step` (counted as DeepSpeed counts `global_steps`: 0 is the first step) is
counted: every micro-batch's forward and backward run under the FLOPs counter, with hooks on
every module (`trident.monitor.flops_profiler`). The counter's per-operator dispatch slows the
step it counts (about 3.5x for a small model on a CPU), so the next step is the one timed: the
same hooks time each module's forward, and the engine's phases (forward, backward, the
pipeline schedule, the optimizer step) and the whole step are timed, with no counter. When that
step ends every rank hands its figures to rank 0 (one all_gather_object over the mesh), which
prints the report, or writes it to `output_file`, under the heading of step `profile_step`.

The engine calls `profile_phase(engine, name)` around its phases and `step_done(engine)` after
each optimizer step; both cost one attribute check when the profiler is off.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from trident.comm import collectives
from trident.monitor import flops_report
from trident.monitor.flops_profiler import FlopsProfiler
from trident.monitor.log import logger
from trident.planner.peak import device_peak

_OFF = contextlib.nullcontext()
WAITING, COUNTING, TIMING, DONE = "waiting", "counting", "timing", "done"


class EngineFlopsProfiler(FlopsProfiler):
    """`engine.flops_profiler`: DeepSpeed's FlopsProfiler, driven by the engine's steps."""

    def __init__(self, engine: Any, settings: Any) -> None:
        super().__init__(engine.module, engine, settings.recompute_fwd_factor, full_shape=engine.strategy.full_shape)
        self.settings = settings
        self.state = WAITING
        self.counted: dict | None = None
        self.phases: dict[str, float] = {}
        self.iter_start: float | None = None
        self.timed_tokens = 0
        self.report: str | None = None  # the text rank 0 printed

    def active(self, global_steps: int) -> bool:
        step = self.settings.profile_step
        return (self.state in (WAITING, COUNTING) and global_steps == step) or \
            (self.state == TIMING and global_steps == step + 1)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.state == WAITING:
            self.reset_profile()
            self.add_hooks()
            self.state = COUNTING
        start = self.clock()
        if self.iter_start is None:
            self.iter_start = start
        try:
            if self.state == COUNTING and name != "step":
                with self.counting():
                    yield
            else:
                yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + self.clock() - start

    def finish_step(self) -> None:
        """After an optimizer step: the counted step becomes the timed one's reference; after
        the timed step, the report."""
        if self.state == COUNTING:
            self.counted = self.rank_profile()
            self.reset_timings()
            self.phases, self.iter_start = {}, None
            self.state = TIMING
        elif self.state == TIMING:
            iter_seconds = self.clock() - self.iter_start
            self.remove_hooks()
            self.state = DONE
            self._report(iter_seconds)


    def _report(self, iter_seconds: float) -> None:
        """Gather every rank's figures; rank 0 writes the report."""
        engine, counted = self.ds_engine, self.counted
        timed = self.module_totals()
        modules = [(n, k, d, s, r, f, timed[n].seconds, timed[n].calls) for n, k, d, s, r, f, *_ in counted["modules"]]
        mine = {**counted, "modules": modules, "forward_seconds": self.get_total_duration(),
                "phases": self.phases, "iter_seconds": iter_seconds, "timed_tokens": self.counted_tokens,
                "coords": _coords(engine)}
        mesh = engine.mesh
        ranks = [mine]
        if mesh is not None and mesh.world_size > 1:
            ranks = [None] * mesh.world_size
            collectives.all_gather_object(ranks, mine, group=mesh.mesh_group)
        if not engine.ranks.writer:
            return
        profile = flops_report.merge(ranks)
        _scale_to_timed_tokens(profile, ranks)
        s = self.settings
        device = _device(engine)
        self.report = flops_report.render(profile, s.profile_step, s.module_depth, s.top_modules, s.detailed,
                                          s.recompute_fwd_factor, _layout(engine), _peak(device), str(device))
        self.report += (f"(FLOPs counted at step {s.profile_step}; latencies timed at step {s.profile_step + 1}, "
                        "without the counter)\n")
        flops_report.emit(self.report, s.output_file)
        if s.output_file:
            logger.info("flops profiler: step %d's report written to %s", s.profile_step, s.output_file)


def attach_flops_profiler(engine: Any) -> None:
    """`engine.flops_profiler` when the config's `flops_profiler.enabled` (else it stays None)."""
    settings = engine.config.flops_profiler
    if settings.enabled:
        engine.flops_profiler = EngineFlopsProfiler(engine, settings)


def profile_phase(engine: Any, name: str) -> contextlib.AbstractContextManager:
    """Around an engine phase (forward, backward, pipeline, step): counted or timed when the
    profiled steps are on, a no-op otherwise."""
    prof = engine.flops_profiler
    if prof is None or not isinstance(prof, EngineFlopsProfiler) or not prof.active(engine.global_steps):
        return _OFF
    return prof.phase(name)


def step_done(engine: Any) -> None:
    """After each optimizer step (global_steps already advanced)."""
    prof = engine.flops_profiler
    if prof is not None and isinstance(prof, EngineFlopsProfiler) and prof.state in (COUNTING, TIMING):
        prof.finish_step()


def _scale_to_timed_tokens(profile: dict, ranks: list[dict]) -> None:
    """The timed step may have fed other tokens than the counted one (ragged batches): the
    iter latency is scaled to the counted step's tokens."""
    timed = max(r["timed_tokens"] for r in ranks)
    if timed and profile["tokens"] and timed != profile["tokens"]:
        profile["iter_seconds"] *= profile["tokens"] / timed


def _coords(engine: Any) -> dict:
    mesh = engine.mesh
    if mesh is None:
        return {"rank": engine.global_rank, "dp": engine.dp_rank}
    return {"rank": mesh.global_rank, "dp": mesh.dp_rank, "pp": mesh.pp_rank, "tp": mesh.tp_rank,
            "cp": mesh.cp_rank, "ep": mesh.ep_rank}


def _layout(engine: Any) -> dict:
    mesh, batch = engine.mesh, engine.batch
    sizes = {"world": engine.world_size, "dp": engine.dp_world_size}
    if mesh is not None:
        sizes.update(tp=mesh.tp_size, pp=mesh.pp_size, cp=mesh.cp_size, ep=mesh.ep_size)
    return {**sizes, "micro_batch": batch.micro_batch_size, "gradient_accumulation_steps": batch.gradient_accumulation_steps}


def _device(engine: Any) -> torch.device:
    first = next(engine.module.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def _peak(device: torch.device) -> tuple[float, str] | None:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return device_peak("cuda", props.name, props.total_memory)
    return device_peak(device.type)

