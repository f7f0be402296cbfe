"""What the parallel packages may ask about a model: the `ModelAdapter` protocol and its registry.

tensor_parallel, pipeline, context_parallel, the engine and checkpointing never name a model
family: they call `adapter_for(model)` and use only the methods below. A family (a folder
under `trident.models`: the reference GPT, LLaMA, GPT-2, ...) registers a finder here when
`trident.models` is imported, which `import trident` does; the finder looks at a model and
returns an adapter bound to it, or None when the model is not of its family.

    adapter = adapter_for(model)         # None: no family knows the model (a plain nn.Module)
    adapter.decoder_layers()             # [(name, module)] from `model`: compile targets, ...
    adapter.tensor_parallel_plan("auto", tp=2)

An adapter is bound to the model it was asked about (`root`); every name it gives is a name
in `root.named_modules()` / `root.state_dict()`, so a user's wrapper around a family's model
(a module returning the loss) gets names that work on the wrapper.

A family that leaves something out says so: `split_pipeline` and `export_root` return None,
`parallelize_context` returns False, the others raise a ValueError saying what to do instead.
See docs/models.md for how a new family is added.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, runtime_checkable

from torch import nn


@runtime_checkable
class ModelAdapter(Protocol):
    """One model family's answers about one model (`root`). Names are from `root`."""

    family: str
    """The family's name ("gpt", "llama", "gpt2", "gpt_neox", "mixtral", "transformers")."""
    root: nn.Module
    """The model the adapter was asked about (a wrapper around the family's model included)."""

    def decoder_layers(self) -> list[tuple[str, nn.Module]]:
        """(name, module) of every decoder layer held here, in model order: what `compile`
        compiles one by one and what a pipeline partition balances. [] when none are known."""

    def embedding_and_head(self) -> tuple[str, str]:
        """Names of the token embedding and of the output head (the same module's weight when
        they are tied)."""

    def tensor_parallel_plan(self, which: str, tp: int) -> Mapping[str, Any]:
        """The {module-name pattern: trident.tensor_parallel style} plan for `which` ("hf": the
        model's own published plan; "auto": that, else the family's preset) at tensor-parallel
        size `tp`; raises ValueError when the family has none."""

    def check_tensor_parallel(self, tp: int) -> None:
        """Before any layer is split: raise ValueError (naming the module) if the model cannot be
        split over `tp` ranks (e.g. attention heads that do not share out)."""

    def localize_tensor_parallel(self, tp: int) -> None:
        """After the plan has split the layers: make the code between them count local sizes
        (e.g. the number of heads an attention module reads from an attribute)."""

    def sequence_parallel_layout(self) -> Any:
        """Where sequence parallelism cuts the model (a trident.tensor_parallel.sequence
        `SequenceParallelLayout`); raises ValueError when the family cannot run on sequence
        shards from outside."""

    def parallelize_context(self, cp: Any) -> bool:
        """Make the model run on `cp`'s (a ContextParallel) chunks of every sequence: its
        attention over the whole sequence, its inputs sharded, its loss a mean over every token.
        False when the family cannot (the caller then refuses the model)."""

    def split_pipeline(self, num_stages: int, *, partition_method: str = "parameters", virtual_stages: int = 1,
                       activation_checkpoint_interval: int = 0, stage_id: int | None = None,
                       trust_layout: bool = False, release: bool = True) -> nn.Module | None:
        """This rank's stage (a trident.pipeline PipelineModule made of the model's own modules),
        or None when the family builds its pipelines otherwise (e.g. `gpt_pipe`)."""

    def state_dict_names(self) -> dict[str, str]:
        """`root.state_dict()` key -> the name the family's own unsplit model gives the tensor
        (what export writes and loading reads), for every tensor the family's model holds."""

    def export_root(self) -> tuple[str, nn.Module] | None:
        """(name, module) of the model an export writes (e.g. the transformers PreTrainedModel
        inside a wrapper), or None when the family exports nothing."""

    def loss_tokens(self, args: tuple, kwargs: dict) -> Any:
        """For a call `root(*args, **kwargs)` that returns the family's mean token loss: how many
        tokens that mean is over (labels other than -100; a count tensor), for token-weighted
        losses (`data.loss_normalization`); None when the call carries no labels the family
        knows (a wrapper with arguments of its own, a call for logits)."""

    def export_record(self) -> dict | None:
        """What a checkpoint's manifest records so that the export can be written later from the
        checkpoint alone (config, names); None when there is nothing to record."""


Finder = Callable[[nn.Module], "ModelAdapter | None"]


_FINDERS: dict[str, tuple[Finder, bool]] = {}  # family name -> (finder, is a fallback)


def register_adapter(name: str, find: Finder, *, fallback: bool = False) -> None:
    """Register family `name`'s finder: `find(model)` returns an adapter bound to `model`, or
    None when the model is not of the family. A `fallback` is asked only after every other
    finder said None (e.g. any transformers model no family folder covers). Registering a name
    again replaces its finder."""
    _FINDERS[name] = (find, fallback)


def registered_families() -> list[str]:
    """The names of the registered families, in the order `adapter_for` asks them."""
    return sorted(_FINDERS, key=lambda name: _FINDERS[name][1])  # stable: registration order within each kind


def adapter_for(model: nn.Module) -> ModelAdapter | None:
    """The adapter of the first family whose finder recognises `model`, or None."""
    for name in registered_families():
        adapter = _FINDERS[name][0](model)
        if adapter is not None:
            return adapter
    return None
