"""What `trident.initialize` takes from DeepSpeed-shaped arguments: Megatron's `mpu`.

A Megatron-DeepSpeed script hands DeepSpeed its model-parallel unit, an object whose methods
return the tensor-, pipeline- and data-parallel groups it already made. trident's mesh orders
ranks as Megatron does (tensor-parallel innermost, pipeline outermost), so the mesh built from
the mpu's sizes has the same groups; this is checked rank by rank, and a mismatch is an error
naming both groups rather than a silent second layout.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from trident.parallel.mesh import ParallelMesh


def _size(mpu: Any, *names: str) -> int:
    for name in names:
        fn = getattr(mpu, name, None)
        if callable(fn):
            return int(fn())
    return 1


def _group(mpu: Any, *names: str):
    for name in names:
        fn = getattr(mpu, name, None)
        if callable(fn):
            return fn()
    return None


def mesh_from_mpu(mpu: Any, cfg, device_type: str):
    """(config with the mpu's tp / pp sizes, the mesh) for `initialize(mpu=...)`."""
    tp = _size(mpu, "get_tensor_model_parallel_world_size", "get_model_parallel_world_size")
    pp = _size(mpu, "get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size")
    for key, ours, theirs in (("tensor_parallel.size", cfg.tensor_parallel.size, tp),
                              ("pipeline.stages", cfg.pipeline.stages, pp)):
        if ours not in (1, theirs):
            raise ValueError(f"config {key} = {ours} but the mpu's group has {theirs} ranks; make them equal "
                             f"or leave {key} out")
    if tp > 1 and cfg.tensor_parallel.plan is None:
        raise ValueError(f"the mpu has {tp} tensor-parallel ranks: trident splits layers itself "
                         "(tensor_parallel.plan, or trident.tensor_parallel layers), and a model with Megatron's "
                         "own tensor-parallel layers is not supported; give tensor_parallel.plan or use tp 1")
    update = {"tensor_parallel": cfg.tensor_parallel.model_copy(update={"size": tp}),
              "pipeline": cfg.pipeline.model_copy(update={"stages": pp})}
    cfg = cfg.model_copy(update=update)
    mesh = ParallelMesh.build(pp=pp, tp=tp, device_type=device_type)
    dp_group = _group(mpu, "get_data_parallel_group")
    if dp_group is not None:
        theirs = sorted(dist.get_process_group_ranks(dp_group))
        ours = sorted(mesh.group_ranks("dp"))
        if theirs != ours:
            raise ValueError(f"the mpu's data-parallel group is ranks {theirs}, trident's mesh would use {ours}; "
                             "trident orders ranks as Megatron does (tp innermost, pp outermost): build the mpu "
                             "in that order")
    return cfg, mesh
