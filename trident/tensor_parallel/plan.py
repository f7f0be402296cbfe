"""Apply tensor parallelism to a model written without trident, by module-name patterns.

A plan maps module-name patterns to styles, in the spirit of torch.distributed.tensor.parallel
and DeepSpeed AutoTP:

    {"fc1": "column", "fc2": "row"}
    {"attn.c_attn": Column(stride=3), "attn.c_proj": "row", "lm_head": "column_gather"}

A pattern matches a module whose dotted name ends with the pattern's components, each
compared with fnmatch (`*` matches within one component): "fc1" matches "fc1" and
"net.fc1"; "h.*.attn.c_proj" matches "transformer.h.3.attn.c_proj". Styles:

    "column"         ColumnParallelLinear, output left split (feed it to a "row" layer)
    "column_gather"  ColumnParallelLinear whose output is gathered (an output head); the
                     vocabulary may be padded to a multiple of tp, the gathered logits are trimmed
    "row"            RowParallelLinear taking a column-split input, output summed (replicated)
    "vocab"          VocabParallelEmbedding (vocabulary padded to a multiple of tp, Megatron-LM's
                     convention)

Each matched nn.Linear / nn.Embedding (or transformers Conv1D, split in its own transposed
layout) is replaced in place by the parallel layer holding its
slice of the existing full weight. Every rank built the same full model from the same seed,
so the sliced model starts from the serial model's weights. Weights tied between modules
(an embedding and its output head) stay tied: both layers share one shard.

The code between the layers is unchanged, so it must work on split activations: attention
must read its local number of heads from the width of its projection's output (as trident's
GPT and HF LLaMA do), and a fused q|k|v projection needs the stride that keeps q, k and v
of the same heads together.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Callable, Mapping, Union

from torch import nn

from trident.comm.logger import CommsLogger
from trident.parallel.adapter import adapter_for
from trident.tensor_parallel.layers import (
    ColumnParallelLinear,
    ReplicatedHeadsLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    _TPModule,
    is_conv1d,
    mark_sequence_parallel,
)
from trident.tensor_parallel.sequence import enable_sequence_parallel
from trident.tensor_parallel.styles import STYLES, Column, KVHeads, Row, Style, SumGrad, Vocab

PRESETS: dict[str, dict[str, Style]] = {}
"""Named plans by module-name convention ("gpt2": GPT-2 / nanoGPT names, "llama": LLaMA's), filled
by the model families of `trident.models` (`register_preset`) when trident is imported."""


def register_preset(name: str, plan: Mapping[str, Style]) -> None:
    """Make `plan` the preset `name` (a model family registers the plan of its module names)."""
    PRESETS[name] = dict(plan)


PlanSpec = Union[str, Mapping[str, Union[str, Style]]]
FAMILY_PLANS = ("hf", "auto")
"""Plans the model's adapter (trident.parallel.adapter) gives: "hf" its published plan, "auto"
that or its family's preset."""


def resolve_plan(plan: PlanSpec) -> dict[str, Style]:
    """A preset name or a {pattern: style name | Style} mapping -> {pattern: Style}."""
    if isinstance(plan, str):
        if plan not in PRESETS:
            raise ValueError(f"tensor_parallel.plan={plan!r} is not a preset; presets: {sorted(PRESETS)}, "
                             f"or give {{module-name pattern: style}} with styles {sorted(STYLES)}")
        return dict(PRESETS[plan])
    if not isinstance(plan, Mapping) or not plan:
        raise ValueError(f"tensor_parallel.plan must be a preset name {sorted(PRESETS)} or a non-empty "
                         f"{{module-name pattern: style}} mapping, got {plan!r}")
    resolved = {}
    for pattern, style in plan.items():
        if isinstance(style, str):
            if style not in STYLES:
                raise ValueError(f"tensor_parallel.plan[{pattern!r}] = {style!r} is not a style; use one of "
                                 f"{sorted(STYLES)}")
            style = STYLES[style]
        elif not isinstance(style, (Column, Row, Vocab, KVHeads, SumGrad)):
            raise ValueError(f"tensor_parallel.plan[{pattern!r}] must be a style name {sorted(STYLES)} or a "
                             f"Column/Row/Vocab object, got {style!r}")
        resolved[pattern] = style
    return resolved


def matches(pattern: str, name: str) -> bool:
    """True if `name` ends with `pattern`'s dotted components (fnmatch per component)."""
    want, have = pattern.split("."), name.split(".")
    return len(want) <= len(have) and all(fnmatchcase(h, w) for h, w in zip(have[-len(want):], want))


def _assignments(model: nn.Module, plan: dict[str, Style]) -> list[tuple[str, nn.Module, Style]]:
    """(name, module, style) for every module the plan matches, with every pattern used."""
    used = {pattern: 0 for pattern in plan}
    # a pipeline stage split from a built model (trident.pipeline.adopted) matches by the model's own
    # module names; a pattern may match modules of other stages only
    rename, whole = model.plan_module_names() if hasattr(model, "plan_module_names") else ({}, ())
    chosen = []
    for name, module in model.named_modules():
        key = rename.get(name, name)
        hits = [p for p in plan if key and matches(p, key)]
        if not hits:
            continue
        styles = {plan[p] for p in hits}
        if len(styles) > 1:
            raise ValueError(f"module {name!r} matches plan patterns {hits} with different styles "
                             f"{[plan[p] for p in hits]}; make the patterns more specific")
        for p in hits:
            used[p] += 1
        chosen.append((name, module, plan[hits[0]]))
    unused = [p for p, n in used.items() if n == 0 and not any(matches(p, w) for w in whole)]
    if unused:
        candidates = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))]
        raise ValueError(f"tensor-parallel plan patterns {unused} match no module of {type(model).__name__}; "
                         f"Linear/Embedding modules are e.g. {candidates[:12]}")
    return chosen


def _check_type(name: str, module: nn.Module, style: Style) -> None:
    if isinstance(module, _TPModule):
        raise ValueError(f"module {name!r} is already a tensor-parallel {type(module).__name__}; a plan applies "
                         f"to a model built from plain nn.Linear / nn.Embedding layers, once")
    want = nn.Embedding if isinstance(style, Vocab) else nn.Linear
    if type(module) is not want and not (want is nn.Linear and is_conv1d(module)):
        kind = "vocab" if isinstance(style, Vocab) else type(style).__name__.lower()
        raise ValueError(f"plan style {kind!r} for module {name!r} needs a torch {want.__name__}, but it is a "
                         f"{type(module).__name__}; point the pattern at the {want.__name__} inside it")


def _make_layer(name: str, module: nn.Module, style: Style, mesh, sequence_parallel: bool,
                logger: CommsLogger | None) -> nn.Module:
    common = dict(sequence_parallel=sequence_parallel, logger=logger)
    try:
        if isinstance(style, Vocab):
            return VocabParallelEmbedding.from_embedding(module, mesh, **common)
        if isinstance(style, KVHeads):
            return ReplicatedHeadsLinear.from_linear(module, mesh, style.head_dim, logger=logger)
        if isinstance(style, Column):
            return ColumnParallelLinear.from_linear(module, mesh, gather_output=style.gather_output,
                                                    stride=style.stride, pad_vocab=style.pad_vocab, **common)
        return RowParallelLinear.from_linear(module, mesh, input_is_parallel=style.input_is_parallel, **common)
    except ValueError as err:
        raise ValueError(f"cannot split module {name!r} over tp={mesh.tp_size}: {err}") from None


def apply_plan(model: nn.Module, plan: PlanSpec, mesh, *,
               sequence_parallel: bool | Callable[[str, Style], bool] = False,
               logger: CommsLogger | None = None) -> list[str]:
    """Replace the modules `plan` matches by tensor-parallel layers; returns their names.

    With `sequence_parallel` the layers take and give sequence shards between a column and a
    row layer: for models whose norms, dropouts and embeddings are written for it (trident's
    GPT), not for a plan applied from outside (see `parallelize`); a callable (name, style) ->
    bool chooses per layer (a transformers model, `sequence.SequenceParallelLayout.uses_shards`).
    """
    adapter = adapter_for(model)
    if isinstance(plan, str) and plan in FAMILY_PLANS:
        if adapter is None:
            raise ValueError(f"tensor_parallel.plan={plan!r} reads a transformers model's own plan, but "
                             f"{type(model).__name__} is not (and holds no) transformers PreTrainedModel; give a "
                             f"preset or a {{module-name pattern: style}} plan")
        plan = adapter.tensor_parallel_plan(plan, mesh.tp_size)
    if adapter is not None:
        adapter.check_tensor_parallel(mesh.tp_size)  # one error naming the module, before any layer is split
    assignments = _assignments(model, resolve_plan(plan))
    shared: dict[int, nn.Parameter] = {}  # id of a full weight -> the shard that replaced it (ties)
    for name, module, style in assignments:
        if isinstance(style, SumGrad):  # stays as it is; its gradients are summed over tp
            for param in module.parameters():
                mark_sequence_parallel(param, mesh, logger)
            continue
        _check_type(name, module, style)
        full_weight = module.weight
        sp = sequence_parallel(name, style) if callable(sequence_parallel) else sequence_parallel
        layer = _make_layer(name, module, style, mesh, sp, logger)
        tied = shared.get(id(full_weight))
        if tied is not None:
            if tied.tp_spec != layer.weight.tp_spec:
                raise ValueError(f"module {name!r} shares its weight with an earlier module split differently "
                                 f"({tied.tp_spec} vs {layer.weight.tp_spec}); split both by vocabulary rows "
                                 f"('vocab' and 'column_gather') or untie them")
            layer.weight = tied
        else:
            shared[id(full_weight)] = layer.weight
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
    if adapter is not None:
        adapter.localize_tensor_parallel(mesh.tp_size)
    if hasattr(model, "after_tensor_parallel"):  # a pipeline stage: tied copies held as buffers again
        model.after_tensor_parallel()
    return [name for name, _, _ in assignments]


def parallelize(model: nn.Module, plan: PlanSpec, mesh, *, logger: CommsLogger | None = None) -> nn.Module:
    """Tensor-parallelise `model` in place over `mesh`'s tp group by `plan`; returns `model`.

    `plan` is a preset name ("gpt2", "llama"), "hf" (a transformers model's own published
    plan), "auto" ("hf" when the model has one, else the preset of its model type; the model's
    `ModelAdapter` gives both) or {module-name pattern: style} (see the module docstring).
    Call it before creating the optimizer: the parameters it replaces are gone.
    Sequence parallelism needs the model's norms and dropouts to run on sequence shards,
    which a name plan cannot arrange; use a model built for it (trident's GPT).
    """
    apply_plan(model, plan, mesh, logger=logger)
    return model


def tp_layers(model: nn.Module) -> list[tuple[str, _TPModule]]:
    """(name, layer) of every trident tensor-parallel layer in `model`."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, _TPModule)]


def _check_built_for(model: nn.Module, tp_cfg, mesh) -> None:
    """The model's TP layers must use this mesh's tp group and the configured sequence parallelism."""
    ranks = mesh.group_ranks("tp")
    for name, layer in tp_layers(model):
        if layer.tp_size != mesh.tp_size or layer.tp_ranks() != ranks:
            raise ValueError(f"tensor-parallel layer {name!r} was built for tp={layer.tp_size} over ranks "
                             f"{layer.tp_ranks()}, but the mesh has tp={mesh.tp_size} over ranks {ranks}; "
                             f"build the model with the mesh trident.initialize uses (pass mesh= to both)")
        if layer.sequence_parallel != tp_cfg.sequence_parallel and mesh.tp_size > 1:
            raise ValueError(f"tensor-parallel layer {name!r} has sequence_parallel={layer.sequence_parallel} "
                             f"but tensor_parallel.sequence_parallel={tp_cfg.sequence_parallel}; build the "
                             f"model with the configured value")


def apply_tensor_parallel(model: nn.Module, tp_cfg, mesh, *, logger: CommsLogger | None = None) -> nn.Module:
    """The `tensor_parallel` config section applied to `model` (in place); returns `model`.

    plan set: `parallelize(model, plan, mesh)`. plan null: the model must already be built
    from trident's tensor-parallel layers for this mesh, or offer
    `parallelize_tensor(mesh, sequence_parallel=..., logger=...)` (trident's GPT does), which
    is then called when tp > 1; with tp=1 a plain model is left exactly as it is.
    """
    if tp_cfg.size != mesh.tp_size:
        raise ValueError(f"tensor_parallel.size={tp_cfg.size} but the mesh has tp={mesh.tp_size}; build the "
                         f"mesh from the same config (ParallelMesh.build(tp={tp_cfg.size}))")
    loaded_split = any(getattr(m, "_trident_tp_loaded", False) for m in model.modules())  # trident.hf.from_pretrained
    if tp_cfg.plan is not None and not loaded_split:
        if tp_cfg.sequence_parallel and mesh.tp_size > 1:
            adapter = adapter_for(model)
            if tp_cfg.plan not in FAMILY_PLANS or adapter is None:
                raise ValueError("tensor_parallel.sequence_parallel=true needs a model whose norms and dropouts run "
                                 "on sequence shards: a transformers model with plan 'hf' or 'auto' (its decoder "
                                 "layers and norms are found from its layout), or a model built for it "
                                 "(trident.models.GPT, plan null); otherwise set sequence_parallel=false")
            layout = adapter.sequence_parallel_layout()
            apply_plan(model, tp_cfg.plan, mesh, sequence_parallel=layout.uses_shards, logger=logger)
            enable_sequence_parallel(model, layout, mesh, logger)
            return model
        return parallelize(model, tp_cfg.plan, mesh, logger=logger)
    if mesh.tp_size > 1 and not tp_layers(model) and hasattr(model, "parallelize_tensor"):
        model.parallelize_tensor(mesh, sequence_parallel=tp_cfg.sequence_parallel, logger=logger)
    if not tp_layers(model) and mesh.tp_size > 1:
        raise ValueError(f"tensor_parallel.size={mesh.tp_size} but {type(model).__name__} has no trident "
                         f"tensor-parallel layers and tensor_parallel.plan is null; set tensor_parallel.plan "
                         f"to a preset {sorted(PRESETS)} or {{module-name pattern: style}} with styles "
                         f"{sorted(STYLES)}, or build the model from trident.tensor_parallel layers")
    _check_built_for(model, tp_cfg, mesh)
    return model

