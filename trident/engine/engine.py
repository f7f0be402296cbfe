"""The training engine: forward, backward, step, checkpoints. It composes; it does not compute.

Gradient accumulation follows DeepSpeed: every micro-batch calls `backward(loss)` then
`step()`; `backward` divides the loss by `gradient_accumulation_steps` so the accumulated
gradient is the mean over the window; only the last micro-step of the window (the boundary)
communicates and runs the optimizer. `global_steps` counts optimizer steps (skipped fp16
overflow steps included, as DeepSpeed counts them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trident.comm import collectives
from trident.comm.logger import CommsLogger
from trident.config.batch import BatchGetters, BatchSizes
from trident.deepspeed.engine.api import DeepSpeedEngineAPI
from trident.deepspeed.engine.settings import LossScale
from trident.engine.flops import profile_phase, step_done
from trident.engine.curriculum import curriculum_for, curriculum_inputs
from trident.engine.reporting import StepReporter
from trident.engine.strategy import GradientStrategy, RemoteStrategy
from trident.engine.timers import Timers
from trident.monitor.log import logger
from trident.engine.token_loss import MICRO_BATCH, TOKENS, TokenWeighting, configured_mode
from trident.parallel.adapter import adapter_for
from trident.parallel.mesh import DENSE_GRADIENT_AXES, ParallelMesh
from trident.precision.mixed import MasterWeights


@dataclass(frozen=True)
class EngineRanks:
    """This process among the ranks that train the model together, under DeepSpeed's names.

    Collective training takes them from its mesh (`of_mesh`). A parameter-server worker's come
    from its layout: dp counts the workers only, global rank 0 is a server, and the workers
    never wait for each other (`group` is None).
    """

    global_rank: int
    world_size: int
    dp_rank: int
    dp_world_size: int
    writer: bool
    """The one rank that writes what a single rank writes (the 16-bit model, the monitors)."""
    group: dist.ProcessGroup | None
    """Every rank of the engine, for barriers; None when the ranks do not wait for each other."""

    @classmethod
    def of_mesh(cls, mesh: ParallelMesh) -> EngineRanks:
        return cls(mesh.mesh_rank, mesh.world_size, mesh.dp_rank, mesh.dp_size, mesh.mesh_rank == 0, mesh.mesh_group)


class Engine(DeepSpeedEngineAPI, BatchGetters, torch.nn.Module):
    """What `trident.initialize` returns; call it like the model, then backward and step."""

    def __init__(
        self,
        module: torch.nn.Module,
        config,
        mesh: ParallelMesh | None,
        batch: BatchSizes,
        master: MasterWeights | None,
        strategy: GradientStrategy,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any,
        loss_scaler: Any,
        comms_logger: CommsLogger | None,
        monitors: Any,
        ranks: EngineRanks | None = None,
    ) -> None:
        """`ranks` default to the mesh's; a builder without a mesh of its own passes them."""
        super().__init__()
        self.module = module
        self.config = config
        self.mesh = mesh
        self.batch = batch
        self.master = master
        self.strategy = strategy
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.loss_scaler = loss_scaler
        self.comms_logger = comms_logger
        self.monitors = monitors
        self.ranks = ranks if ranks is not None else EngineRanks.of_mesh(mesh)
        self.compute_dtype = next(module.parameters()).dtype
        self.timers = Timers(config.wall_clock_breakdown)
        self.global_steps = 0
        self.micro_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self._global_grad_norm: float | None = None
        self._window_loss: torch.Tensor | float = 0.0
        self._last_loss: torch.Tensor | float | None = None  # read on the host only when asked
        self.last_step_overflowed = False
        self.training_dataloader = None      # set by initialize when it builds the loader
        self.parameter_counts: dict[str, int] | None = None  # {"trainable", "frozen"} elements, set by initialize
        self.resumed_client_state = None     # client_state of the checkpoint auto_resume loaded
        self._backward_pending = False
        self._window_open = False
        self._pending_read = None  # a PendingRead the next optimizer step checks (the pipeline engine's)
        self._grad_factor: torch.Tensor | None = None  # the next step's token-weighting factor
        self.token_weighting = _token_weighting(module, config, mesh, strategy)
        self.curriculum_scheduler_legacy = curriculum_for(config)  # DeepSpeed's name; None when off
        self.reporter = StepReporter(next(module.parameters()).device)

    # -- coordinates (DeepSpeed names) -----------------------------------------------------

    @property
    def global_rank(self) -> int:
        """This process's rank among the engine's ranks: its mesh's (the job's under a parameter server)."""
        return self.ranks.global_rank

    @property
    def world_size(self) -> int:
        return self.ranks.world_size

    @property
    def dp_rank(self) -> int:
        return self.ranks.dp_rank

    @property
    def dp_world_size(self) -> int:
        return self.ranks.dp_world_size

    @property
    def loss_scale(self) -> LossScale:
        """The current loss scale (1.0 without fp16); calling it, `engine.loss_scale()`, gives
        DeepSpeed's meaning: the configured fp16.loss_scale (0 = dynamic)."""
        current = self.loss_scaler.loss_scale if self.loss_scaler is not None else 1.0
        return LossScale(current, self.config.fp16.loss_scale)

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    @property
    def reducer(self) -> GradientStrategy:
        """The gradient strategy under its first-wave name (kept for scripts that used it)."""
        return self.strategy

    @property
    def last_loss(self) -> float | None:
        """The mean loss of the last accumulation window. Kept on the device until read, so a
        step that nobody logs costs no host sync for it."""
        if isinstance(self._last_loss, torch.Tensor):
            self._last_loss = float(self._last_loss)
        return self._last_loss

    @last_loss.setter
    def last_loss(self, value: torch.Tensor | float | None) -> None:
        self._last_loss = value.detach() if isinstance(value, torch.Tensor) else value

    def get_global_grad_norm(self) -> float | None:
        """Norm of the averaged gradient at the last optimizer step, before clipping."""
        return self._global_grad_norm

    def curriculum_seqlen(self) -> int | None:
        """The curriculum's sequence length for the step about to run (`curriculum_learning`;
        DeepSpeed's schedule at global_steps + 1), or None without a curriculum."""
        scheduler = self.curriculum_scheduler_legacy
        return None if scheduler is None else scheduler.update_difficulty(self.global_steps + 1)

    # -- training --------------------------------------------------------------------------

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the model; floating-point inputs are cast to the model's dtype (bf16/fp16)."""
        self._start_window()
        with self.timers("forward"), profile_phase(self, "forward"):
            inputs, kwargs = curriculum_inputs(self, inputs, kwargs)
            self.reporter.count_inputs(inputs, kwargs)
            self.token_weighting.count_forward(inputs, kwargs)
            inputs, kwargs = _cast_floats((inputs, kwargs), self.compute_dtype)
            return self.module(*inputs, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True,
                 num_tokens: Any = None) -> torch.Tensor:
        """Backpropagate `loss` (scaled for fp16 and averaged over the accumulation window, or
        weighted by its token count: `num_tokens` is how many tokens a loss of one's own is a mean
        over, `trident.engine.token_loss`).

        On the accumulation boundary the gradient all-reduce runs inside this call,
        overlapped with backward.
        """
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(
                "engine.backward(loss) needs a scalar loss tensor, got "
                f"{type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}; "
                "reduce your loss to one number (e.g. loss.mean()) first"
            )
        if self._backward_pending:
            raise RuntimeError(
                "engine.backward() was called twice without engine.step() in between; call "
                "engine.step() after every engine.backward() (it only updates the weights on "
                "gradient-accumulation boundaries)")
        self._start_window()
        tokens = self.token_weighting.weigh(loss, num_tokens)
        scale = self.loss_scale
        if tokens is not None:  # the loss sum; the step divides by the global count
            scale = tokens.float() * scale
        else:
            self._window_loss = self._window_loss + loss.detach().float()
            if scale_wrt_gas:
                scale /= self.batch.gradient_accumulation_steps
        with self.timers("backward"), profile_phase(self, "backward"):
            self.strategy.start_backward(boundary=self.is_gradient_accumulation_boundary())
            (loss.float() * scale).backward(retain_graph=retain_graph)
            self.strategy.finish_backward()
        self._backward_pending = True
        # DeepSpeed returns the loss as it scales it for accumulation (not the fp16 loss scale)
        return loss / self.batch.gradient_accumulation_steps if scale_wrt_gas and tokens is None else loss

    def step(self) -> None:
        """Advance one micro-step; on the boundary, take the optimizer step."""
        boundary = self.is_gradient_accumulation_boundary()
        self._boundary_override = None  # set_gradient_accumulation_boundary holds for one micro-step
        self.micro_steps += 1  # before the boundary step: a periodic checkpoint it writes counts this micro-step
        if boundary:
            weighted = self.token_weighting.close_window()
            if weighted is not None:
                self._grad_factor, window_loss = weighted
            else:
                window_loss = self._window_loss / self.batch.gradient_accumulation_steps
            self._boundary_step(window_loss)
            self._window_loss = 0.0
            self._window_open = False
        self._backward_pending = False

    def _start_window(self) -> None:
        """The first forward or backward of an accumulation window tells the strategy."""
        if not self._window_open:
            self.strategy.start_window()
            self._window_open = True

    def _boundary_step(self, window_loss: float) -> None:
        """The optimizer step that ends an accumulation window, and its bookkeeping.

        `window_loss` is the mean loss of the window, for logging (a tensor stays on the
        device until someone reads `last_loss`). The pipeline engine calls this once per
        `train_batch`.
        """
        with self.timers("step"), profile_phase(self, "step"):
            self._take_model_step()
        self.last_loss = window_loss
        self.global_steps += 1
        step_done(self)  # the FLOPs profiler: the counted step ends, or the report after the timed one
        self.global_samples += self.batch.train_batch_size
        self._report()
        ckpt = self.config.checkpoint
        if ckpt.path and ckpt.save_interval and self.global_steps % ckpt.save_interval == 0:
            from trident.checkpointing.state import prune_checkpoints
            loader = self.training_dataloader
            sampler = getattr(loader, "sampler", None)
            client = {"sampler": sampler.state_dict()} if hasattr(sampler, "state_dict") else {}
            self.save_checkpoint(ckpt.path, client_state=client)
            if ckpt.keep_last and self.global_rank == 0:
                prune_checkpoints(ckpt.path, ckpt.keep_last)

    def _take_model_step(self) -> None:
        # The strategy clips and applies the update wherever its optimizer runs (this rank's
        # partitions, or parameter servers) and returns the norm; a non-finite one, the same on
        # every rank, means nothing was applied: the overflow check.
        pending, self._pending_read = self._pending_read, None
        factor, self._grad_factor = self._grad_factor, None
        norm = self.strategy.step(self.config.gradient_clipping, self.loss_scale, self._grad_split_groups(),
                                  self.lr_scheduler, pending, factor)
        overflow = norm is not None and not math.isfinite(norm)
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(overflow)
        elif overflow:
            self._nonfinite_gradients()
        self.last_step_overflowed = overflow
        if overflow:
            self.skipped_steps += 1
            self._global_grad_norm = None
            if self.loss_scaler is not None:
                logger.warning("step %d: fp16 gradient overflow, step skipped; loss scale now %g",
                               self.global_steps + 1, self.loss_scale)
        else:
            self._global_grad_norm = norm
        self.strategy.zero_grad()

    def _nonfinite_gradients(self) -> None:
        """fp32/bf16: name the first parameter (in model order) whose gradient is not finite on
        any rank, then stop or skip the step as `numerics.on_nonfinite` says."""
        local = self.strategy.nonfinite_names()
        everywhere: list = [None] * self.mesh.world_size
        collectives.all_gather_object(everywhere, local, group=self.mesh.mesh_group)
        bad = {n for names in everywhere for n in names}
        order = [n for n, _ in self.module.named_parameters()]
        first = next((n for n in order if n in bad), None)
        what = (f"the gradient of {first} ({len(bad)} parameter(s) in all) holds NaN or inf"
                if first else "a gradient holds NaN or inf")
        message = f"step {self.global_steps + 1}: {what}"
        if self.config.numerics.on_nonfinite == "stop":
            raise FloatingPointError(message + "; stopping (numerics.on_nonfinite = \"stop\"; set it to "
                                               "\"skip\" to skip such steps instead)")
        logger.warning("%s; step skipped (numerics.on_nonfinite = \"skip\")", message)

    def _grad_split_groups(self) -> tuple[dist.ProcessGroup, ...]:
        """Groups over which gradients are split; none in plain data parallelism."""
        return ()

    def _report(self) -> None:
        self.reporter.report(self)  # monitors every step, the log line every steps_per_print (engine/reporting.py)

    # -- accounting ------------------------------------------------------------------------

    def memory_breakdown(self, split_parameters: bool = False) -> dict[str, int]:
        """Bytes of model states this rank holds: {"parameters", "gradients", "optimizer_states"}.

        fp32 master weights count as optimizer states, as in the ZeRO paper; scalar optimizer
        state (Adam's step counter) is not counted. Frozen parameters (a LoRA base) count as
        parameters only; `split_parameters=True` reports them apart: {"trainable_parameters",
        "frozen_parameters", "gradients", "optimizer_states"}.
        """
        mem = self.strategy.memory_breakdown()
        if not split_parameters:
            return mem
        frozen = self.strategy.frozen_bytes()
        return {"trainable_parameters": mem["parameters"] - frozen, "frozen_parameters": frozen,
                "gradients": mem["gradients"], "optimizer_states": mem["optimizer_states"]}

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict in the compute dtype, on every rank, ZeRO partitions gathered
        (collective under stage 3); tensor-parallel slices stay each rank's, as DeepSpeed's
        consolidation leaves them (`trident.engine.full_state.full_state_dict` merges them too)."""
        from trident.engine.full_state import full_state_dict
        return full_state_dict(self, merge_tp=False)

    def destroy(self) -> None:
        """Release what outlives a step: offload swap files and I/O threads, a parameter-server
        worker's connections (DeepSpeed's name; also run at interpreter exit), the monitors'
        files. The engine cannot train afterwards."""
        self.strategy.close()
        if self.monitors is not None:
            self.monitors.close()

    close = destroy

    # -- parameters held elsewhere (a `RemoteStrategy`: parameter-server workers) ----------

    def fetch_parameters(self) -> None:
        """Bring the newest parameters into the model now (for evaluation, or at the end of an
        asynchronous run); a no-op where they are this rank's own and always current."""
        if isinstance(self.strategy, RemoteStrategy):
            self.strategy.fetch_parameters()

    @property
    def server_version(self) -> int:
        """The oldest version among the parameters this rank holds (updates applied to them)."""
        return self._remote("server_version").server_version

    def comm_bytes(self) -> dict[str, int]:
        """Bytes this rank has sent to and received from the processes holding the parameters."""
        return self._remote("comm_bytes()").comm_bytes()

    def _remote(self, what: str) -> RemoteStrategy:
        if not isinstance(self.strategy, RemoteStrategy):
            raise RuntimeError(f"engine.{what} is for strategies whose parameters live on other processes "
                               f"(parameter_server.servers > 0); this engine's {type(self.strategy).__name__} "
                               "holds them on this rank")
        return self.strategy

    # -- checkpoints -----------------------------------------------------------------------

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """Write the model's weights in the compute dtype to save_dir/save_filename (rank 0;
        collective): DeepSpeed's method, `trident.engine.full_state.save_16bit_model`."""
        from trident.engine.full_state import save_16bit_model
        return save_16bit_model(self, save_dir, save_filename)

    @property
    def tokens_in_step(self) -> float | None:
        """The global number of counted tokens of the last token-weighted step (its loss was the
        mean over them, `data.loss_normalization`); None before one, or when averaged per micro-batch."""
        count = self.token_weighting.tokens_in_step
        if isinstance(count, torch.Tensor):
            count = self.token_weighting.tokens_in_step = float(count)
        return count

    def save_pretrained(self, save_dir: str, max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None):
        """Write the transformers model inside as `from_pretrained` reads it (`trident.hf.save_pretrained`:
        config.json and safetensors shards, whole tensors from any layout; collective)."""
        from trident.hf.export import save_pretrained
        return save_pretrained(self, save_dir, max_shard_size=max_shard_size, dtype=dtype)

    def save_adapters(self, save_dir: str, base_model_name_or_path: str | None = None, **kwargs):
        """Write the LoRA adapters, whole, in peft's format (`trident.peft.save_adapters`; collective)."""
        from trident.peft.export import save_adapters
        return save_adapters(self, save_dir, base_model_name_or_path, **kwargs)

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True) -> str:
        """Write model, optimizer, scheduler and RNG state under save_dir/tag, atomically (a
        `RemoteStrategy` saves where the state is)."""
        if isinstance(self.strategy, RemoteStrategy):
            return self.strategy.save_checkpoint(self, save_dir, tag, client_state or {}, save_latest)
        from trident.checkpointing.state import save_checkpoint
        return save_checkpoint(self, save_dir, tag=tag, client_state=client_state or {},
                               save_latest=save_latest, records=self._manifest_records())

    def _manifest_records(self) -> dict[str, dict | None]:
        """What a checkpoint's manifest records about the model for the offline tools: the LoRA
        adapters' scaling (`trident checkpoint merge-lora`) and a transformers model's config and
        names (`trident checkpoint export-hf`)."""
        from trident.parallel.adapter import adapter_for
        from trident.peft.merge import lora_record
        lora = getattr(self.config, "lora", None)  # else LoRA applied by hand: read off the layers
        adapter = adapter_for(self.module)
        return {"lora": {"r": lora.r, "alpha": lora.alpha} if lora is not None else lora_record(self.module),
                "hf": adapter.export_record() if adapter is not None else None}

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False):
        """Load a checkpoint; returns (path, client_state), or (None, None) if none exists.

        A DeepSpeed checkpoint folder is converted first (`trident checkpoint import-deepspeed`,
        into a temporary folder on every rank) and then loaded like a trident checkpoint."""
        imported = self._load_imported_checkpoint(load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
                                                  load_module_only)
        if imported is not None:
            return imported
        if isinstance(self.strategy, RemoteStrategy):
            return self.strategy.load_checkpoint(self, load_dir, tag, load_optimizer_states,
                                                 load_lr_scheduler_states, load_module_only)
        from trident.checkpointing.state import load_checkpoint
        return load_checkpoint(self, load_dir, tag=tag, load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states,
                               load_module_only=load_module_only)

    def training_state(self) -> dict:
        """Counters, scheduler and loss scaler: the state every rank shares. The optimizer state
        and masters (per rank under ZeRO) come from `self.strategy.state_dict()`."""
        return {
            "global_steps": self.global_steps,
            "micro_steps": self.micro_steps,
            "global_samples": self.global_samples,
            "skipped_steps": self.skipped_steps,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
            "curriculum": (self.curriculum_scheduler_legacy.state_dict()
                           if self.curriculum_scheduler_legacy is not None else None),
        }

    def load_training_state(self, state: dict, load_optimizer_states: bool, load_lr_scheduler_states: bool) -> None:
        for key in ("global_steps", "micro_steps", "global_samples", "skipped_steps"):
            setattr(self, key, state[key])
        if load_optimizer_states and self.loss_scaler is not None and state["loss_scaler"] is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        if load_lr_scheduler_states and self.lr_scheduler is not None and state["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if self.curriculum_scheduler_legacy is not None and state.get("curriculum") is not None:
            self.curriculum_scheduler_legacy.load_state_dict(state["curriculum"])


def _token_weighting(module: torch.nn.Module, config, mesh: ParallelMesh | None, strategy) -> TokenWeighting:
    """`data.loss_normalization` for this engine: token-weighted where the gradient is averaged
    over the dense gradient group on this rank (not for parameter-server workers)."""
    mode = configured_mode(config)
    if isinstance(strategy, RemoteStrategy) or mesh is None:
        if config.data.loss_normalization == TOKENS:
            raise ValueError("data.loss_normalization \"tokens\" is not supported with parameter servers (the "
                             "servers average the workers' windows); set it to \"micro_batch\" or null")
        return TokenWeighting(MICRO_BATCH, None, None, 1, 1, explicit=True)
    return TokenWeighting(mode, adapter_for(module), mesh.group(*DENSE_GRADIENT_AXES),
                          mesh.topology.size(DENSE_GRADIENT_AXES), mesh.cp_size,
                          explicit=config.data.loss_normalization is not None)


def _cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    if dtype == torch.float32:
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floats(x, dtype) for x in obj)
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype) for k, v in obj.items()}
    return obj
