"""`deepspeed.pipe`'s names: `PipelineModule`, `LayerSpec`, `TiedLayerSpec` (trident.pipeline's).

`PipelineModule` here takes DeepSpeed's constructor arguments. `seed_layers=True` seeds each
layer with `base_seed + layer index` before building it (DeepSpeed's way to make every
partition build the same weights); a value that asks for something trident's pipeline does not
do (`topology=`, a custom activation checkpoint function) is refused by name.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from trident.pipeline.module import LayerSpec, TiedLayerSpec
from trident.pipeline.module import PipelineModule as _TridentPipelineModule

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec", "ProcessTopology"]


class PipelineModule(_TridentPipelineModule):
    """trident's PipelineModule with DeepSpeed's signature: `PipelineModule(layers, num_stages,
    topology=None, loss_fn=None, seed_layers=False, seed_fn=None, base_seed=1234,
    partition_method="parameters", activation_checkpoint_interval=0,
    activation_checkpoint_func=None, checkpointable_layers=None, dynamic_shape=False)`."""

    def __init__(self, layers: Sequence[Any], num_stages: int | None = None, topology: Any = None,
                 loss_fn: Callable | None = None, seed_layers: bool = False, seed_fn: Callable | None = None,
                 base_seed: int = 1234, partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable | None = None, checkpointable_layers: Any = None,
                 dynamic_shape: bool = False, **trident_args: Any) -> None:
        del dynamic_shape  # activation shapes are exchanged at the first batch (reset_activation_shape)
        if topology is not None:
            if num_stages is None and hasattr(topology, "get_dim"):
                num_stages = topology.get_dim("pipe")
            else:
                raise ValueError("PipelineModule(topology=...) is not supported: trident takes the layout from the "
                                 "config and the launcher; give num_stages instead")
        if num_stages is None:
            raise ValueError("PipelineModule needs num_stages= (DeepSpeed's alternative, topology=, is not supported)")
        # Set before the parent builds this stage's layers (in its __init__, through _build).
        object.__setattr__(self, "_layer_seed", (seed_fn or _seed_everything, base_seed) if seed_layers else None)
        if activation_checkpoint_func is not None or checkpointable_layers is not None:
            raise ValueError("PipelineModule(activation_checkpoint_func= / checkpointable_layers=) is not supported; "
                             "activation_checkpoint_interval=k recomputes every run of k layers with trident's "
                             "checkpoint")
        super().__init__(layers, num_stages, loss_fn=loss_fn, partition_method=partition_method,
                         activation_checkpoint_interval=activation_checkpoint_interval, **trident_args)


    def _build(self, idx: int):
        """DeepSpeed's seed_layers: layer `idx` is built right after seeding with base_seed + idx,
        so every stage builds the weights one process would, whatever the partition."""
        if self._layer_seed is not None:
            seed_fn, base_seed = self._layer_seed
            seed_fn(base_seed + idx)
        return super()._build(idx)


def _seed_everything(seed: int) -> None:
    import random

    import numpy as np
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class ProcessTopology:
    """Not available: trident's layout comes from the config (see trident.parallel.topology)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("deepspeed.pipe.ProcessTopology is not supported by trident: the mesh comes from "
                                  "the config (pipeline.stages, tensor_parallel.size); give PipelineModule num_stages")
