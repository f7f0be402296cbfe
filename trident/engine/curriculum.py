"""DeepSpeed's legacy sequence-length curriculum on the engine (`curriculum_learning`).

DeepSpeed's engine, before each training forward, moves its `curriculum_scheduler_legacy` to
step `global_steps + 1` and passes the length to the model as `curriculum_seqlen=`; Megatron's
GPT then cuts its inputs to that many positions. trident does the same for a model whose forward
takes a `curriculum_seqlen` argument; for any other model (trident's GPT, a transformers model)
the engine cuts the inputs itself: dimension 1 of every input tensor of two or more dimensions
(`trident.data.curriculum.truncate`). `engine.curriculum_seqlen()` tells a loop of one's own the
length of the step about to run (for a loss or a loader of its own); `trident train` cuts its
loader's batches to it before counting tokens. The pipeline engine cuts the micro-batches of
each `train_batch` and re-exchanges activation shapes when the length changes (DeepSpeed's rule).
"""

from __future__ import annotations

import inspect
from typing import Any, Iterator

import torch

from trident.data.curriculum import CurriculumScheduler, truncate


def curriculum_for(config: Any) -> CurriculumScheduler | None:
    """The scheduler of the config's `curriculum_learning` section, or None when it is off."""
    section = getattr(config, "curriculum_learning", None)
    return CurriculumScheduler(section) if section is not None and section.enabled else None


def takes_curriculum_seqlen(module: torch.nn.Module) -> bool:
    """Whether the model's forward names a `curriculum_seqlen` parameter (DeepSpeed's contract)."""
    try:
        return "curriculum_seqlen" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def curriculum_inputs(engine: Any, inputs: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A training forward's inputs under the curriculum: the length passed as `curriculum_seqlen`
    to a model that takes it, else every sequence input cut to it."""
    if engine.curriculum_scheduler_legacy is None or not engine.module.training:
        return inputs, kwargs
    seqlen = engine.curriculum_seqlen()
    if takes_curriculum_seqlen(engine.module):
        return inputs, {**kwargs, "curriculum_seqlen": seqlen}
    return truncate(inputs, seqlen), truncate(kwargs, seqlen)


def curriculum_batches(engine: Any, data_iter: Iterator | None) -> Iterator | None:
    """The pipeline engine's micro-batches of one `train_batch` under the curriculum; on every
    rank, activation shapes are exchanged again where the length changes (DeepSpeed's rule)."""
    scheduler = engine.curriculum_scheduler_legacy
    if scheduler is None:
        return data_iter
    seqlen = scheduler.update_difficulty(engine.global_steps + 1)
    if engine.global_steps == 0 or scheduler.first_step:
        engine.reset_activation_shape()
        scheduler.first_step = False
    elif seqlen != scheduler.get_difficulty(engine.global_steps):
        engine.reset_activation_shape()
    return None if data_iter is None else (truncate(batch, seqlen) for batch in data_iter)
