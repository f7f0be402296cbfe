"""trident's planner: predict memory, communication and step time, and choose a layout.

    est = trident.planner.estimate("gpt3-175b", Layout(dp=8, tp=8, pp=16, micro_batch=1,
                                   activation_checkpointing="full"), make_cluster("a100-80gb", 1024),
                                   Workload(seq_len=2048, global_batch=1536))
    print(est.format())

Pure arithmetic: nothing here starts processes or touches torch.distributed. The ZeRO
model-state formulas live in `trident.planner.memory` and nowhere else.
"""

from trident.planner.estimate import Estimate, estimate
from trident.planner.layout import Layout, Workload, grad_accumulation, layout_problems
from trident.planner.memory import (ModelStates, StateBytes, lora_parameters, mixed_precision_bytes,
                                    model_state_bytes, trident_state_bytes, zero_paper_bytes, zero_state_table)
from trident.planner.presets import (GPU_PRESETS, MODEL_PRESETS, Cluster, GPUSpec, ModelSpec, gpu_preset, make_cluster,
                                     model_from_gpt_config, model_from_hf_config, model_preset)
from trident.planner.search import Candidate, SearchResult, search

__all__ = [
    "Estimate", "estimate", "Layout", "Workload", "grad_accumulation", "layout_problems", "ModelStates", "StateBytes",
    "lora_parameters", "mixed_precision_bytes", "model_state_bytes", "trident_state_bytes", "zero_paper_bytes", "zero_state_table",
    "GPU_PRESETS", "MODEL_PRESETS", "Cluster", "GPUSpec", "ModelSpec", "gpu_preset", "make_cluster",
    "model_from_gpt_config", "model_from_hf_config", "model_preset", "Candidate", "SearchResult", "search",
]
