"""The pipeline-parallel engine: one `train_batch` streams the micro-batches through the stages.

Micro-batches are the gradient-accumulation steps: a batch of M micro-batches accumulates M
gradients on every stage, then takes one optimizer step. Each stage runs its own instruction
list (`trident.pipeline.schedules`) through a `StageExecutor`; the loss on the last stage is
scaled by loss_scale / M before backward, as `Engine.backward` does for accumulation.

After the schedule every rank of the mesh takes part in one agreement (an all-reduce of
[failed?, loss share]): all ranks learn the batch's mean loss, and if any stage failed, all of
them raise the same `PipelineError` (the earliest failure's message) instead of stepping.

Weights tied across stages (`TiedLayerSpec`): every holder computes a gradient for its copy;
`ReduceTiedGrads` sums them onto the first holding stage (the owner) and zeroes the others'
copies, so the owner steps with the full gradient and the copies add nothing to the gradient
norm (a tied weight counts once in clipping, exactly as in the serial model). After the step
the owner broadcasts the updated weights to the other holders. (Their optimizer sees a zero
gradient; whatever it does to the copy is overwritten by that broadcast.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from trident.comm import collectives
from trident.engine.engine import Engine
from trident.monitor.log import logger
from trident.parallel.mesh import ParallelMesh
from trident.pipeline.executor import PipelineError, StageExecutor, StageResult
from trident.pipeline.instructions import OptimizerStep, ReduceTiedGrads
from trident.pipeline.module import PipelineModule
from trident.pipeline.schedules import build_all, build_schedule, forward_only
from trident.pipeline.simulate import simulate


@dataclass
class TiedWeights:
    """The parameters shared under one key, on this rank, and the group of their holders."""

    key: str
    params: list[torch.nn.Parameter]
    grads: list[torch.Tensor]  # the reducer's fp32 gradient views of `params`
    group: dist.ProcessGroup
    owner: bool


class PipelineEngine(Engine):
    """What `trident.initialize` returns for a `PipelineModule`: call `train_batch(data_iter)`.

    `data_iter` yields one (inputs, labels) pair per micro-batch; only the first stage (inputs)
    and the last (labels) read it, so other stages may pass None.
    """

    def __init__(self, *engine_args: Any, schedule: str, micro_batches: int,
                 grad_group: dist.ProcessGroup | None, ties: list[TiedWeights]) -> None:
        super().__init__(*engine_args)
        module: PipelineModule = self.module
        self.schedule = schedule
        self.micro_batches = micro_batches
        self.ties = ties
        stages, stage, v = module.num_stages, module.stage_id, module.virtual_stages
        self.train_program = build_schedule(schedule, stages, micro_batches, stage, v)
        self.eval_program = forward_only(stages, micro_batches, stage, v)
        act_group = self.mesh.pp_group if stages > 1 else None
        self.executor = StageExecutor(module, act_group, grad_group, self.compute_dtype, self.reducer)
        self._batch_loss = 0.0
        self._step_handlers = {ReduceTiedGrads: self._reduce_tied_grads, OptimizerStep: self._optimizer_step}

    # -- coordinates -----------------------------------------------------------------------

    @property
    def stage_id(self) -> int:
        return self.module.stage_id

    @property
    def num_stages(self) -> int:
        return self.module.num_stages

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    # -- batches ---------------------------------------------------------------------------

    def train_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """Forward and backward M micro-batches through the pipeline, then one optimizer step.

        Returns the mean loss over the micro-batches (and the data-parallel replicas), on every rank.
        """
        self.module.train()
        split = next(i for i, instr in enumerate(self.train_program) if isinstance(instr, ReduceTiedGrads))
        result = self.executor.run(self.train_program[:split], data_iter,
                                   loss_scale=self.loss_scale / self.micro_batches, train=True)
        self._batch_loss = self._agree(result, "train_batch")
        for instr in self.train_program[split:]:
            self._step_handlers[type(instr)]()
        self.micro_steps += self.micro_batches
        return torch.tensor(self.last_loss)

    @torch.no_grad()
    def eval_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """Forward M micro-batches (no gradients, no step); the mean loss, on every rank."""
        was_training = self.module.training
        self.module.eval()
        try:
            result = self.executor.run(self.eval_program, data_iter, train=False)
        finally:
            self.module.train(was_training)
        return torch.tensor(self._agree(result, "eval_batch"))

    def reset_activation_shape(self) -> None:
        """Re-exchange activation shapes at the next batch (call on every rank, between batches)."""
        self.executor.reset_shapes()

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a pipeline engine runs whole batches: call engine.train_batch(data_iter) or "
                           "engine.eval_batch(data_iter) instead of engine(...), backward() and step()")

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward()

    def step(self) -> None:
        self.forward()

    # -- agreement and step ----------------------------------------------------------------

    def _agree(self, result: StageResult, what: str) -> float:
        """One all-reduce over the mesh: did any stage fail, and the mean loss of the batch."""
        mesh = self.mesh
        share = 0.0
        if self.is_last_stage() and result.losses:
            share = sum(result.losses) / len(result.losses) / (mesh.dp_size * mesh.tp_size)
        status = torch.tensor([1.0 if result.error else 0.0, share], dtype=torch.float64)
        collectives.all_reduce(status, group=mesh.mesh_group)
        if status[0] == 0:
            return float(status[1])
        report = None if result.error is None else (result.failed_at, self.stage_id, mesh.global_rank, result.error)
        reports: list = [None] * mesh.world_size
        dist.all_gather_object(reports, report, group=mesh.mesh_group)
        failed = sorted(r for r in reports if r is not None)
        _, stage, rank, error = failed[0]
        others = "".join(f"\n(stage {s}, global rank {r} failed too: {e.splitlines()[0]})" for _, s, r, e in failed[1:])
        raise PipelineError(f"{what}: pipeline stage {stage} (global rank {rank}) raised {error.rstrip()}"
                            f"{others}") from result.exception

    def _reduce_tied_grads(self) -> None:
        for tie in self.ties:
            for grad in tie.grads:
                collectives.reduce(grad, dst=0, group=tie.group)
                if not tie.owner:
                    grad.zero_()  # the owner holds the sum; a copy must not count twice in the norm

    def _optimizer_step(self) -> None:
        self._boundary_step(self._batch_loss)
        with torch.no_grad():
            for tie in self.ties:
                for p in tie.params:
                    collectives.broadcast(p.data, src=0, group=tie.group)

    def _grad_split_groups(self) -> tuple[dist.ProcessGroup, ...]:
        """The stages hold different parameters: norms and overflow checks span the pp group."""
        extra = (self.mesh.pp_group,) if self.mesh.pp_size > 1 else ()
        return super()._grad_split_groups() + extra


def build_pipeline_engine(module: PipelineModule, cfg, mesh: ParallelMesh, batch, master, reducer, optimizer,
                          lr_scheduler, loss_scaler, comms_logger, monitors) -> PipelineEngine:
    """The pipeline engine over what `trident.initialize` built for a `PipelineModule`.

    Collective over the pipeline's ranks (creates their gradient and tied-weight groups).
    """
    micro_batches = _check_layout(module, cfg, mesh, batch)
    grad_group = None
    if mesh.pp_size > 1:
        # A second group over the same ranks: gradients travel FIFO apart from activations.
        grad_group = dist.new_group(mesh.group_ranks("pp"), use_local_synchronization=True)
    ties = _tie_groups(module, mesh, reducer)
    engine = PipelineEngine(module, cfg, mesh, batch, master, reducer, optimizer, lr_scheduler, loss_scaler,
                            comms_logger, monitors, schedule=cfg.pipeline.schedule,
                            micro_batches=micro_batches, grad_group=grad_group, ties=ties)
    _log_pipeline(engine)
    return engine


def _check_layout(module: PipelineModule, cfg, mesh: ParallelMesh, batch) -> int:
    """The number of micro-batches, after checking the module, the config and the mesh agree."""
    if not isinstance(module, PipelineModule):
        raise TypeError(f"build_pipeline_engine needs a trident.pipeline.PipelineModule, got {type(module).__name__}")
    pipe = cfg.pipeline
    if not (module.num_stages == pipe.stages == mesh.pp_size):
        raise ValueError(f"pipeline stages disagree: PipelineModule(num_stages={module.num_stages}), config "
                         f"pipeline.stages={pipe.stages}, mesh pp size {mesh.pp_size}; make them equal")
    if module.stage_id != mesh.pp_rank:
        raise ValueError(f"this rank is pipeline stage {mesh.pp_rank} of the mesh but its PipelineModule was "
                         f"built as stage {module.stage_id}; build it with stage_id=mesh.pp_rank")
    if module.virtual_stages != pipe.virtual_stages:
        raise ValueError(f"PipelineModule(virtual_stages={module.virtual_stages}) differs from config "
                         f"pipeline.virtual_stages={pipe.virtual_stages}; make them equal")
    if pipe.virtual_stages > 1 and (pipe.schedule != "interleaved_1f1b" or pipe.stages < 2):
        raise ValueError(f"pipeline.virtual_stages={pipe.virtual_stages} needs schedule \"interleaved_1f1b\" "
                         f"and at least 2 stages (got schedule {pipe.schedule!r}, {pipe.stages} stage(s))")
    if cfg.zero_optimization.stage > 1:
        raise ValueError(f"zero_optimization.stage={cfg.zero_optimization.stage} does not combine with pipeline "
                         f"parallelism (every micro-batch's backward would reduce-scatter gradients); use "
                         f"stage 0 or 1")
    gas = batch.gradient_accumulation_steps
    if pipe.micro_batches is not None and pipe.micro_batches != gas:
        raise ValueError(f"pipeline.micro_batches={pipe.micro_batches} but gradient_accumulation_steps={gas}: "
                         f"micro-batches are the accumulation steps; set one of them, or both equal")
    return gas


def _tie_groups(module: PipelineModule, mesh: ParallelMesh, reducer) -> list[TiedWeights]:
    """A group per tied key over the stages holding it (same dp and tp coordinates as this rank).

    Only the holders create it (local synchronisation); then the owner's weights are broadcast
    so every copy starts equal.
    """
    index = {id(p): i for i, p in enumerate(reducer.params)}
    ties = []
    for key, stages in module.tied_stages.items():
        if len(stages) < 2 or mesh.pp_rank not in stages:
            continue
        ranks = [mesh.ranks[mesh.topology.rank_of(pp=s, dp=mesh.dp_rank, tp=mesh.tp_rank)] for s in stages]
        group = dist.new_group(ranks, use_local_synchronization=True)
        params = module.tied_parameters(key)
        with torch.no_grad():
            for p in params:
                collectives.broadcast(p.data, src=0, group=group)
        ties.append(TiedWeights(key, params, [reducer.grads[index[id(p)]] for p in params], group,
                                owner=mesh.pp_rank == stages[0]))
    return ties


def _log_pipeline(engine: PipelineEngine) -> None:
    module = engine.module
    stages, v, m = module.num_stages, module.virtual_stages, engine.micro_batches
    timeline = simulate(build_all(engine.schedule, stages, m, v))
    logger.info("pipeline: schedule %s, %d stage(s) x %d chunk(s), %d micro-batches; bubble %.1f%% at equal "
                "stage costs; stage %d keeps up to %d micro-batch activations", engine.schedule, stages, v, m,
                100 * timeline.bubble_fraction(), module.stage_id, timeline.peak_live[module.stage_id])
