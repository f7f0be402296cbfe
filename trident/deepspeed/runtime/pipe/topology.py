"""`deepspeed.runtime.pipe.topology`: DeepSpeed's topology classes. trident builds the mesh from
the config (`pipeline.stages`, `tensor_parallel.size`) or from `initialize(mpu=...)`; a
topology object passed to `PipelineModule(topology=...)` is refused by name there."""

from trident.deepspeed.pipe import ProcessTopology

PipeDataParallelTopology = PipeModelDataParallelTopology = ProcessTopology

__all__ = ["ProcessTopology", "PipeDataParallelTopology", "PipeModelDataParallelTopology"]
