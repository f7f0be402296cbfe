"""The pipeline-parallel engine: one `train_batch` streams the micro-batches through the stages.

Micro-batches are the gradient-accumulation steps: a batch of M micro-batches accumulates M
gradients on every stage, then takes one optimizer step. Each stage runs its own instruction
list (`trident.pipeline.schedules`) through a `StageExecutor`; the loss on the last stage is
scaled by loss_scale / M before backward, as `Engine.backward` does for accumulation.

During the schedule gradients only accumulate locally, so nothing but point-to-point traffic
runs. Then every rank of the mesh takes part in one agreement (an all-reduce of [failed?, loss
share]): all ranks learn the batch's mean loss, and if any stage failed, all of them raise the
same `PipelineError` (the earliest failure's message) instead of stepping. Only then come the
step instructions:

    ReduceTiedGrads  weights tied across stages (`TiedLayerSpec`) are parameters on the first
                     stage holding them (the owner) and buffer copies elsewhere. Each copy's
                     gradient is accumulated in fp32 and sent to the owner as soon as its
                     stage's schedule ends (the owner posted the receive before its own
                     schedule, so the transfer overlaps its last backward); here the owner
                     waits for them and sums them.
    ReduceGrads      one boundary pass of the gradient strategy (`start_backward(boundary=True)`,
                     `finish_backward()`): the owner first adds the copies' gradient to its
                     parameters through autograd, so the data-parallel reduction (all-reduce,
                     or ZeRO-1's reduce-scatter) covers it like any other gradient.
    OptimizerStep    `Engine._boundary_step`; then the owner broadcasts the new weights to
                     the copies.

A tied weight thus has one optimizer state and counts once in the gradient norm, as in the
serial model. The price of accumulating locally is that the data-parallel reduction is not
overlapped with the last backward.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist

from trident.comm import collectives, p2p
from trident.deepspeed.engine.pipe_api import DeepSpeedPipelineAPI
from trident.engine.curriculum import curriculum_batches
from trident.engine.engine import Engine
from trident.engine.flops import profile_phase
from trident.engine.token_loss import MICRO_BATCH, TOKENS, configured_mode
from trident.moe.parallel import moe_layers
from trident.monitor.log import logger
from trident.parallel.mesh import ParallelMesh
from trident.pipeline.executor import PipelineError, StageExecutor, StageResult
from trident.optim.step import PendingRead
from trident.pipeline.instructions import STEP, OptimizerStep, ReduceGrads, ReduceTiedGrads
from trident.pipeline.module import PipelineModule
from trident.pipeline.schedules import build_all, build_schedule, forward_only
from trident.pipeline.simulate import simulate
from trident.pipeline.ties import TiedWeights, tie_weights


class PipelineEngine(DeepSpeedPipelineAPI, Engine):
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
        self.executor = StageExecutor(module, act_group, grad_group, self.compute_dtype, self.strategy)
        self._batch_loss = 0.0
        self._tied_transfers: list = []  # this step's sends / receives of tied-copy gradients
        self._tied_incoming: list[tuple[torch.Tensor, list[torch.Tensor]]] = []  # owner: (sum, received)
        self._step_handlers = {ReduceTiedGrads: self._reduce_tied_grads, ReduceGrads: self._reduce_grads,
                               OptimizerStep: self._optimizer_step}
        self._token_weighted = self._decide_token_weighting()

    def _decide_token_weighting(self) -> bool:
        """`data.loss_normalization` for a pipeline: token-weighted when the loss can count its
        tokens (`loss_fn.loss_tokens`) and no stage adds auxiliary losses (MoE), whose per-micro-
        batch weights the count cannot scale; the same answer on every rank (one all-reduce)."""
        mode = configured_mode(self.config)
        countable = callable(getattr(self.module.loss_fn, "loss_tokens", None))
        aux = torch.tensor([float(bool(moe_layers(self.module)))], device=self.executor.device)
        collectives.all_reduce(aux, op=dist.ReduceOp.MAX, group=self.mesh.mesh_group)
        if mode == TOKENS and (not countable or aux.item()):
            why = ("its loss_fn has no loss_tokens(labels) saying how many tokens its mean is over" if not countable
                   else "a stage adds auxiliary (MoE) losses, whose weights the count cannot scale")
            raise ValueError(f"data.loss_normalization is \"tokens\", but this pipeline cannot weight its loss by "
                             f"tokens: {why}; set data.loss_normalization to \"micro_batch\" or null")
        return mode != MICRO_BATCH and countable and not aux.item()

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
        Without `data_iter`, the micro-batches come from `initialize(training_data=...)`'s loader,
        repeated (DeepSpeed's behaviour).
        """
        data_iter = curriculum_batches(self, self._batches(data_iter))  # cut to the curriculum's length
        self.module.train()
        split = next(i for i, instr in enumerate(self.train_program) if isinstance(instr, STEP))
        self._post_tied_receives()
        weighted = self._token_weighted
        with self.timers("pipeline"), profile_phase(self, "pipeline"):
            result = self.executor.run(self.train_program[:split], data_iter, train=True, token_weighted=weighted,
                                       loss_scale=self.loss_scale if weighted else self.loss_scale / self.micro_batches)
        self._send_tied_grads()
        # Whether a stage failed is read with the gradient norm, before anything is applied:
        # one host sync a step. Every rank runs the step's collectives either way, so none waits.
        status = self._status(result)
        self._batch_loss = status[1]
        if weighted:  # the gradient factor and the global token mean (trident.engine.token_loss)
            self._grad_factor, self._batch_loss = self.token_weighting.factor_and_mean(
                status[2:3] * self.mesh.cp_size, status[3] * self.mesh.cp_size)
        self._pending_read = PendingRead(status, lambda values: self._stop_if_failed(values, result, "train_batch"))
        self.micro_steps += self.micro_batches  # before the step: a periodic checkpoint it writes counts them
        for instr in self.train_program[split:]:
            self._step_handlers[type(instr)]()
        if self._pending_read is not None:  # a program without an optimizer step still checks
            pending, self._pending_read = self._pending_read, None
            pending.resolve()
        return self._batch_loss.float()

    def _default_data_iter(self) -> Iterator | None:
        if self.training_dataloader is None:
            return None
        if getattr(self, "_repeating", None) is None:
            from trident.data.repeating_loader import RepeatingLoader
            loader = self.training_dataloader  # initialize's is already repeating; set_dataloader's may not be
            self._repeating = loader if isinstance(loader, RepeatingLoader) else RepeatingLoader(loader)
        return self._repeating

    @torch.no_grad()
    def eval_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """Forward M micro-batches (no gradients, no step); the mean loss, on every rank."""
        was_training = self.module.training
        self.module.eval()
        try:
            result = self.executor.run(self.eval_program, data_iter, train=False)
        finally:
            self.module.train(was_training)
        status = self._status(result)
        values = status.tolist()
        self._raise_if_failed(values, result, "eval_batch")
        return torch.tensor(values[1])

    def reset_activation_shape(self) -> None:
        """Re-exchange activation shapes at the next batch (call on every rank, between batches)."""
        self.executor.reset_shapes()

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        raise _whole_batches_only()

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise _whole_batches_only()

    def step(self) -> None:
        raise _whole_batches_only()

    # -- agreement and step ----------------------------------------------------------------

    def _status(self, result: StageResult) -> torch.Tensor:
        """One all-reduce over the mesh, left on the device: [stages that failed, the mean loss of
        the batch] (the last stage's, plus every stage's auxiliary losses: `trident.pipeline.aux_loss`)."""
        mesh = self.mesh
        replicas = mesh.world_size // mesh.pp_size
        device = self.executor.device
        status = torch.zeros(4, dtype=torch.float64, device=device)
        status[0] = 1.0 if result.error else 0.0
        if self.is_last_stage() and result.counts:  # token-weighted: [2] the global count, [3] the loss sum
            counts = torch.stack(result.counts).to(device, torch.float64)
            shared = mesh.tp_size * mesh.cp_size  # tp and cp ranks count the same sequences
            status[2] += counts.sum() / shared
            status[3] += (counts * torch.stack(result.losses).to(device, torch.float64)).sum() / shared
        if self.is_last_stage() and result.losses:
            # every last-stage rank (dp x cp x ep x tp of them) adds its share; cp and tp ranks
            # report the same batch's loss, dp and ep ranks their own batches'
            status[1] += torch.stack(result.losses).to(device, torch.float64).sum() / (len(result.losses) * replicas)
        if result.aux_losses:  # every stage's auxiliary losses (MoE), per micro-batch, join the loss
            status[1] += torch.stack(result.aux_losses).to(device, torch.float64).sum() / (self.micro_batches * replicas)
        collectives.all_reduce(status, group=mesh.mesh_group)
        return status

    def _stop_if_failed(self, values: list[float], result: StageResult, what: str) -> None:
        """After the step's collectives: drop the batch and raise on every rank if a stage failed."""
        if values[0] != 0:
            self._abandon_step()
        self._raise_if_failed(values, result, what)

    def _raise_if_failed(self, values: list[float], result: StageResult, what: str) -> None:
        """Raise the first stage's error on every rank (collective when a stage failed)."""
        if values[0] == 0:
            return
        mesh = self.mesh
        report = None if result.error is None else (result.failed_at, self.stage_id, mesh.global_rank, result.error)
        reports: list = [None] * mesh.world_size
        collectives.all_gather_object(reports, report, group=mesh.mesh_group)
        failed = sorted(r for r in reports if r is not None)
        _, stage, rank, error = failed[0]
        others = "".join(f"\n(stage {s}, global rank {r} failed too: {e.splitlines()[0]})" for _, s, r, e in failed[1:])
        raise PipelineError(f"{what}: pipeline stage {stage} (global rank {rank}) raised {error.rstrip()}"
                            f"{others}") from result.exception

    def _post_tied_receives(self) -> None:
        """Owner: post a receive for every copy's gradient before the schedule starts."""
        for tie in self.ties:
            if tie.owner:
                for total in tie.sums:
                    bufs = [torch.empty_like(total) for _ in range(1, dist.get_world_size(tie.group))]
                    self._tied_transfers += [p2p.irecv(b, src, group=tie.group) for src, b in enumerate(bufs, 1)]
                    self._tied_incoming.append((total, bufs))

    def _send_tied_grads(self) -> None:
        """Copies: send the accumulated gradient to the owner (group rank 0) as the schedule ends."""
        for tie in self.ties:
            if not tie.owner:
                self._tied_transfers += [p2p.isend(total, 0, group=tie.group) for total in tie.sums]

    def _reduce_tied_grads(self) -> None:
        for handle in self._tied_transfers:
            handle.wait()
        for total, bufs in self._tied_incoming:
            total.copy_(torch.stack(bufs).sum(0))
        self._tied_transfers, self._tied_incoming = [], []

    def _abandon_step(self) -> None:
        """After a failed batch (its tied gradients already reduced): drop every accumulated gradient."""
        for tie in self.ties:
            for total in tie.sums:
                total.zero_()
        self.strategy.zero_grad()

    def _reduce_grads(self) -> None:
        self.strategy.start_backward(boundary=True)
        owned = [(t, s.to(t.dtype)) for tie in self.ties if tie.owner for t, s in zip(tie.tensors, tie.sums)]
        if owned:
            torch.autograd.backward([t for t, _ in owned], [s for _, s in owned])
        self.strategy.finish_backward()

    @torch.no_grad()
    def _optimizer_step(self) -> None:
        self._boundary_step(self._batch_loss)
        for tie in self.ties:
            for t, total in zip(tie.tensors, tie.sums):
                collectives.broadcast(t.data, src=0, group=tie.group)
                total.zero_()

    def _grad_split_groups(self) -> tuple[dist.ProcessGroup, ...]:
        """The stages hold different parameters: norms and overflow checks span the pp group."""
        extra = (self.mesh.pp_group,) if self.mesh.pp_size > 1 else ()
        return super()._grad_split_groups() + extra


def _whole_batches_only() -> RuntimeError:
    return RuntimeError("a pipeline engine runs whole batches: call engine.train_batch(data_iter) or "
                        "engine.eval_batch(data_iter) instead of engine(...), engine.backward() and engine.step()")


def build_pipeline_engine(module: PipelineModule, cfg, mesh: ParallelMesh, batch, master, strategy, optimizer,
                          lr_scheduler, loss_scaler, comms_logger, monitors) -> PipelineEngine:
    """The pipeline engine over what `trident.initialize` built for a `PipelineModule`.

    Collective over every rank of the job (the mesh creates process groups, in the same order everywhere).
    """
    micro_batches = _check_layout(module, cfg, mesh, batch)
    grad_group, ties = None, []
    if mesh.pp_size > 1:
        if mesh.world_size != dist.get_world_size():
            raise ValueError(f"pipeline parallelism needs a mesh over every rank of the job (this mesh has "
                             f"{mesh.world_size} of {dist.get_world_size()}); build it with ParallelMesh.build()")
        # A second group over each pipeline's ranks: gradients travel FIFO apart from activations.
        grad_group = mesh.subgroup("pp", range(mesh.pp_size), tag="pp-grads")
        ties = tie_weights(module, mesh)
    engine = PipelineEngine(module, cfg, mesh, batch, master, strategy, optimizer, lr_scheduler, loss_scaler,
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
    if cfg.zero_optimization.stage > 1 and pipe.stages > 1:
        raise ValueError(f"zero_optimization.stage={cfg.zero_optimization.stage} does not combine with pipeline "
                         f"parallelism over {pipe.stages} stages: stage 2 partitions each gradient as its "
                         f"backward runs, but a weight tied across stages (the embedding) only gets its "
                         f"other stages' share after the schedule ends, and stage 3 would re-gather every "
                         f"layer for every micro-batch; use stage 0 or 1 (stages 2 and 3 work with "
                         f"pipeline.stages = 1)")
    if pipe.partition_method != module.partition_method:
        logger.warning("config pipeline.partition_method=%r differs from PipelineModule(partition_method=%r); "
                       "the module's partition is used (the layers are already built)", pipe.partition_method,
                       module.partition_method)
    gas = batch.gradient_accumulation_steps
    if pipe.micro_batches is not None and pipe.micro_batches != gas:
        raise ValueError(f"pipeline.micro_batches={pipe.micro_batches} but gradient_accumulation_steps={gas}: "
                         f"micro-batches are the accumulation steps; set one of them, or both equal")
    return gas


def _log_pipeline(engine: PipelineEngine) -> None:
    module = engine.module
    stages, v, m = module.num_stages, module.virtual_stages, engine.micro_batches
    timeline = simulate(build_all(engine.schedule, stages, m, v))
    logger.info("%s", module.describe_partition())
    logger.info("pipeline: schedule %s, %d stage(s) x %d chunk(s), %d micro-batches; bubble %.1f%% at equal "
                "stage costs; stage %d keeps up to %d micro-batch activations", engine.schedule, stages, v, m,
                100 * timeline.bubble_fraction(), module.stage_id, timeline.peak_live[module.stage_id])
