"""Pipeline parallelism: layers split over stages, micro-batches streamed through them.

    PipelineModule, LayerSpec, TiedLayerSpec      the model, built stage by stage (module.py)
    gpipe, one_f_one_b, interleaved_1f1b, zb_h1   schedules as pure functions (schedules.py)
    simulate, check_schedule, Costs               timelines, bubbles, well-formedness (simulate.py)
    StageExecutor                                 runs a stage's instructions (executor.py)
    add_aux_loss                                  a layer's auxiliary loss (MoE) into the loss (aux_loss.py)
    from_hf, hf_state_dict                        a built model (transformers) split into stages by its
                                                  family's adapter, under the model's names (adopted.py)

The engine that drives them is `trident.engine.pipeline_engine.PipelineEngine`.
"""

from trident.pipeline.aux_loss import add_aux_loss
from trident.pipeline.executor import PipelineError, StageExecutor
from trident.pipeline.instructions import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    Instruction,
    LoadMicroBatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
)
from trident.pipeline.adopted import (
    AdoptedPipelineModule,
    ModelPart,
    from_hf,
    hf_shard_specs,
    hf_state_dict,
    load_hf_state_dict,
)
from trident.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec
from trident.pipeline.partition import partition_balanced, partition_uniform
from trident.pipeline.schedules import (
    SCHEDULES,
    build_all,
    build_schedule,
    forward_only,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zb_h1,
)
from trident.pipeline.simulate import Costs, ScheduleError, Timeline, check_schedule, simulate

HFPipelineModule = AdoptedPipelineModule
"""A stage `from_hf` split from a transformers model (the generic class, under its public name)."""

__all__ = [
    "AdoptedPipelineModule", "Backward", "BackwardInput", "BackwardWeight", "Costs", "Forward", "HFPipelineModule",
    "Instruction", "LayerSpec", "LoadMicroBatch", "ModelPart", "OptimizerStep", "PipelineError", "PipelineModule", "RecvActivation", "RecvGrad",
    "ReduceGrads", "ReduceTiedGrads", "SCHEDULES", "ScheduleError", "SendActivation", "SendGrad",
    "StageExecutor", "TiedLayerSpec", "Timeline", "add_aux_loss", "build_all", "build_schedule", "check_schedule",
    "forward_only", "from_hf", "gpipe", "hf_shard_specs", "hf_state_dict", "interleaved_1f1b",
    "load_hf_state_dict", "one_f_one_b", "partition_balanced", "partition_uniform",
    "simulate", "zb_h1",
]
