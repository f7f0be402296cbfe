"""Tensor (intra-layer) parallelism: weights split over the tp ranks of a ParallelMesh.

mappings: the conjugate communication pairs; layers: column / row parallel linear layers and
the vocabulary-parallel embedding; cross_entropy: the loss over vocabulary-split logits;
dropout: masks equal to one process's; split: shard specs and state-dict split / merge;
plan: `parallelize(model, plan, mesh)` for models written without trident (styles: how a plan
splits a module; "hf" / "auto" plans come from the model's `ModelAdapter`), and
`apply_tensor_parallel` for the config's `tensor_parallel` section; sequence: sequence
parallelism where the adapter says the model's layers are.
"""

from trident.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from trident.tensor_parallel.dropout import SequenceParallelDropout, unit_dropout_mask
from trident.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    is_tp_split,
    mark_sequence_parallel,
)
from trident.tensor_parallel.mappings import (
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)
from trident.tensor_parallel.plan import (
    PRESETS,
    STYLES,
    Column,
    Row,
    Vocab,
    apply_plan,
    apply_tensor_parallel,
    parallelize,
    tp_layers,
)
from trident.tensor_parallel.split import ShardSpec, merge_state_dicts, shard_specs, split_state_dict

__all__ = [
    "PRESETS", "STYLES", "Column", "ColumnParallelLinear", "Row", "RowParallelLinear", "SequenceParallelDropout",
    "ShardSpec", "Vocab", "VocabParallelEmbedding", "apply_plan", "apply_tensor_parallel", "copy_to_tp_region",
    "gather_from_sequence_parallel_region", "gather_from_tp_region", "is_tp_split", "mark_sequence_parallel",
    "merge_state_dicts", "parallelize", "reduce_from_tp_region", "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region", "scatter_to_tp_region", "shard_specs", "split_state_dict",
    "tp_layers", "unit_dropout_mask", "vocab_parallel_cross_entropy",
]
