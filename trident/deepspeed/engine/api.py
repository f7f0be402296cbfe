"""DeepSpeed's engine API: the methods a DeepSpeed script calls besides forward/backward/step.

`trident.engine.engine.Engine` inherits `DeepSpeedEngineAPI`, so these live apart from the
engine's own work (forward, backward, step, checkpoints) and read only its attributes
(`module`, `strategy`, `last_step_overflowed`, `comms_logger`). The accumulation boundary
override is read by `is_gradient_accumulation_boundary` and cleared by the engine's `step`.

Loading another framework's checkpoint folder goes through importers registered here
(`register_checkpoint_importer`): `trident.deepspeed.checkpoint` registers DeepSpeed's when
imported (`import trident` imports it), so the engine never imports a checkpoint format above it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from trident.deepspeed.comm import Comm
from trident.deepspeed.engine.attributes import DeepSpeedAttributesAPI
from trident.deepspeed.engine.settings import DeepSpeedSettingsAPI
from trident.deepspeed.engine.surface import unsupported


class CheckpointImporter(NamedTuple):
    """`detects(load_dir, tag)`: the folder is in this format; `convert(load_dir, out, tag)`:
    write it as a trident checkpoint folder `out`, returned."""

    detects: Callable[[str, str | None], bool]
    convert: Callable[[str, str, str | None], Path]


_importers: list[CheckpointImporter] = []


def register_checkpoint_importer(detects: Callable[[str, str | None], bool],
                                 convert: Callable[[str, str, str | None], Path]) -> None:
    """Let `engine.load_checkpoint` read another framework's checkpoint folders (converted first)."""
    importer = CheckpointImporter(detects, convert)
    if importer not in _importers:
        _importers.append(importer)


class DeepSpeedEngineAPI(DeepSpeedSettingsAPI, DeepSpeedAttributesAPI):
    """DeepSpeed's engine methods, over what `Engine` holds. Every public name of DeepSpeed's
    engine is here, in the config accessors (`DeepSpeedSettingsAPI`), the attributes
    (`DeepSpeedAttributesAPI`), or `trident.deepspeed.engine.surface`'s table of names trident does not
    implement, which `__getattr__` turns into an error saying what to use instead."""

    _surface_kind = "engine"

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # torch.nn.Module's: parameters, buffers, submodules
        except AttributeError:
            error = unsupported(type(self)._surface_kind, name)
            if error is None:
                raise
            raise error from None

    @property
    def device(self) -> torch.device:
        """The device the model computes on."""
        return next(self.module.parameters(), torch.empty(0)).device

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (LOCAL_RANK, as DeepSpeed reports it)."""
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def comm(self) -> Comm:
        """`deepspeed.comm` bound to this engine's comms logger: its calls are timed there, whatever
        other engine the process holds (the module-level functions log to the process's logger)."""
        return Comm(self.comms_logger)

    def zero_optimization_stage(self) -> int:
        return self.strategy.zero_stage

    def was_step_applied(self) -> bool:
        """False when the last optimizer step was skipped (fp16 overflow, or a skipped non-finite step)."""
        return not self.last_step_overflowed

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Say whether the coming backward and step end an accumulation window, overriding the
        count (DeepSpeed's escape hatch for loops that vary their accumulation)."""
        self._boundary_override = bool(is_boundary)

    def is_gradient_accumulation_boundary(self) -> bool:
        if getattr(self, "_no_sync", False):
            return False
        override = getattr(self, "_boundary_override", None)
        return super().is_gradient_accumulation_boundary() if override is None else override

    def no_sync(self):
        """Context in which backward accumulates gradients locally without communicating.
        Refused under ZeRO stages 2-3, which reduce gradients into partitions during backward."""
        if self.zero_optimization_stage() >= 2:
            raise RuntimeError(f"engine.no_sync() is not supported under ZeRO stage {self.zero_optimization_stage()}: "
                               "gradients are partitioned as backward runs (DeepSpeed refuses it too)")

        @contextlib.contextmanager
        def local_backward():
            self._no_sync = True
            try:
                yield
            finally:
                self._no_sync = False
        return local_backward()

    def train_batch(self, data_iter=None):
        raise RuntimeError("engine.train_batch() is the pipeline engine's (model built as trident.pipe."
                           "PipelineModule); for this engine call loss = engine(inputs), engine.backward(loss), "
                           "engine.step()")

    def eval_batch(self, data_iter=None, *args, **kwargs):
        raise RuntimeError("engine.eval_batch() is the pipeline engine's (model built as trident.pipe."
                           "PipelineModule); for this engine call engine.eval() and engine(inputs) under "
                           "torch.no_grad()")

    def _load_imported_checkpoint(self, load_dir: str, tag: str | None, *flags: bool):
        """(path, client_state) when `load_dir` holds another framework's checkpoint (a DeepSpeed
        one): converted into a temporary folder on every rank, then loaded like a trident
        checkpoint with the same flags; None for a trident checkpoint."""
        importer = next((i for i in _importers if i.detects(load_dir, tag)), None)
        if importer is None:
            return None
        with tempfile.TemporaryDirectory(prefix="trident-ds-import-") as tmp:
            folder = importer.convert(load_dir, f"{tmp}/ckpt", tag)
            _, client_state = self.load_checkpoint(str(folder.parent), folder.name, *flags)
        return f"{load_dir}/{folder.name}", client_state
