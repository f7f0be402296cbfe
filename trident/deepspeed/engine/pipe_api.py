"""DeepSpeed's PipelineEngine names beyond `train_batch` / `eval_batch`: the data iterator and
batch function a script sets, the stage coordinates, DeepSpeed's switches (layer 8, a mixin
`trident.engine.pipeline_engine.PipelineEngine` inherits).

`train_batch(data_iter)` keeps `data_iter` for the batches after it, as DeepSpeed does
(`set_dataiterator`); without one it reads the loader `initialize(training_data=...)` built (or
`set_dataloader`'s). `set_batch_fn(fn)` maps every micro-batch read through `fn` first.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from trident.monitor.log import logger


class DeepSpeedPipelineAPI:
    """PipelineEngine's DeepSpeed names, over `stage_id`, `num_stages`, `mesh`, `batch`."""

    _surface_kind = "pipeline engine"
    data_iterator: Iterator | None = None
    batch_fn: Callable | None = None
    has_attention_mask = False
    dynamic_shape = False
    is_pipe_partitioned = False
    is_grad_partitioned = False
    pipeline_enable_backward_allreduce = True

    def set_dataloader(self, loader) -> None:
        """Read the coming batches from `loader` (first and last stages; DeepSpeed's `set_dataloader`)."""
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = loader
            self.data_iterator = iter(loader)

    def set_dataiterator(self, iterator: Iterator) -> None:
        """Read the coming batches from `iterator` (first and last stages)."""
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = None
            self.data_iterator = iterator

    def set_batch_fn(self, fn: Callable) -> None:
        """Apply `fn` to every micro-batch read from the data iterator."""
        self.batch_fn = fn

    def set_has_attention_mask(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"set_has_attention_mask takes a bool, got {type(value).__name__}")
        self.has_attention_mask = value

    def _batches(self, data_iter: Iterator | None) -> Iterator | None:
        """The micro-batches `train_batch` reads: `data_iter` (kept for later batches), else the
        iterator set before, else initialize's loader; through `batch_fn` when one is set."""
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        source = self.data_iterator if self.data_iterator is not None else self._default_data_iter()
        if source is None or self.batch_fn is None:
            return source
        return map(self.batch_fn, source)

    def get_pipeline_parallel_rank(self) -> int:
        return self.stage_id

    @property
    def prev_stage(self) -> int:
        return self.stage_id - 1

    @property
    def next_stage(self) -> int:
        return self.stage_id + 1

    @property
    def micro_batch_size(self) -> int:
        return self.train_micro_batch_size_per_gpu()

    @property
    def is_pipe_parallel(self) -> bool:
        return self.num_stages > 1

    @property
    def is_data_parallel(self) -> bool:
        return self.dp_world_size > 1

    @property
    def is_model_parallel(self) -> bool:
        return self.mesh.tp_size > 1

    @property
    def loss(self):
        """The mean loss of the last batch (DeepSpeed's `engine.loss` after train_batch)."""
        return self.last_loss

    def get_additional_losses(self) -> None:
        return None  # DeepSpeed's hook for auxiliary losses; trident adds MoE's to the loss itself

    def log_for_device(self, *msg: Any) -> None:
        logger.info("stage %d: %s", self.stage_id, " ".join(str(m) for m in msg))

    def tput_log(self, *msg: Any) -> None:
        if self.global_rank == 0 and self.global_steps % (self.steps_per_print() or 1) == 0:
            logger.info(" ".join(str(m) for m in msg))
