"""What ZeRO-3 gathers, module by module: the units of its per-module collectives.

Stage 3 gathers each module's own parameters with one collective just before the module runs
(DeepSpeed's stage 3 and trident's `trident.zero.stage3` alike); modules of at most
`stage3_param_persistence_threshold` elements (norms, biases) stay whole on every rank. The
traffic (`comm.zero3_gathers`), the step's schedule (`zero3`) and the gathered buffers
(`memory.comm_buffer_bytes`) all read the modules from here.
"""

from __future__ import annotations

from trident.planner.layout import Layout, Workload, stage_layers
from trident.planner.presets import ModelSpec


def zero3_layer_modules(model: ModelSpec, layout: Layout) -> list[tuple[str, float]]:
    """One transformer layer's modules in forward order as (name, elements on one rank): the
    norms, the qkv and output projections, then each local expert's (or the one MLP's) input
    and output layer. Stage 3 gathers each module's own parameters with one collective."""
    h, t, b = model.d_model, layout.tp, int(model.bias)
    experts = model.num_experts // layout.ep if model.num_experts else 1
    mlp_in = (2 if model.gated_mlp else 1) * model.ff_dim
    mlp = [("mlp_in", (h * mlp_in + b * mlp_in) / t), ("mlp_out", (model.ff_dim * h + b * h) / t)] * experts
    return [("norm", model._norm_params()), ("qkv", (h * (h + 2 * model.kv_dim) + b * (h + 2 * model.kv_dim)) / t),
            ("proj", (h * h + b * h) / t), ("norm", model._norm_params()), *mlp]


def zero3_outer_modules(model: ModelSpec, layout: Layout) -> tuple[list[float], list[float]]:
    """(before the layers, after them): the embedding (tokens and learned positions, and an
    embedding norm), then the final norm and an untied output layer."""
    h, t = model.d_model, layout.tp
    embedding = model.vocab_size * h / t + (model.seq_len * h if model.position == "learned" else 0)
    first = [embedding] + ([model._norm_params()] if model.embed_norm else [])
    return first, [model._norm_params()] + ([model.vocab_size * h / t] if not model.tie_embeddings else [])


FP8_GATHERED = frozenset({"qkv", "proj", "mlp_in", "mlp_out"})
"""The layer modules whose weights `fp8.all_gather` gathers as float8 (those `fp8` converts)."""


def zero3_module_elements(model: ModelSpec, layout: Layout, workload: Workload) -> list[float]:
    """Elements of each module stage 3 gathers on one rank per micro-batch pass, in forward
    order: the embedding, every layer's linear layers (norms and biases under the persistence
    threshold stay whole), the head. trident and DeepSpeed gather per module: one collective each."""
    return [e for _, e in zero3_named_module_elements(model, layout, workload)]


def zero3_named_module_elements(model: ModelSpec, layout: Layout, workload: Workload) -> list[tuple[str, float]]:
    """`zero3_module_elements` with each module's name (zero3_layer_modules' names; "outer" for
    the embedding, the final norm and the head)."""
    first, last = zero3_outer_modules(model, layout)
    modules = ([("outer", e) for e in first] + zero3_layer_modules(model, layout) * stage_layers(model, layout.pp)
               + [("outer", e) for e in last])
    return [(n, m) for n, m in modules if m > workload.zero3_persistence_threshold]


def zero3_kept_for_backward(elements: list[float], workload: Workload) -> list[bool]:
    """Under full recomputation, which of a layer's gathered modules (forward order) stay gathered
    from the recomputed forward to their backward: those whose next use comes within
    `stage3_max_reuse_distance` elements of gathers (the later modules' recompute, then their
    backward: twice their elements). The last module's backward follows its recompute at once."""
    return [2 * sum(elements[i + 1:]) <= workload.zero3_max_reuse_distance for i in range(len(elements))]
