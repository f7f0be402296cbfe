"""`initialize(model_parameters=...)` mapped onto the parameters the engine trains.

DeepSpeed takes `model_parameters` as any iterable of parameters (a list, a generator, a
`filter`) or of param-group dicts with their own hyperparameters (`lr`, `weight_decay`...).
`trident.initialize` transforms the model before it builds the optimizer: the tensor-parallel
plan replaces weights by their shards, LoRA wraps layers (the base frozen, adapters added), a
Hugging Face model is split into this rank's pipeline stage, compile wraps blocks, ZeRO-3
partitions. An optimizer over the tensors the user passed would update tensors nobody reads.

So the request is recorded *before* any transform, by parameter name, and resolved afterwards:

  1. a parameter object that is still in the model is itself;
  2. else its name, read past the wrappers a transform inserts (`_orig_mod.` of compile, the
     `base.` of a LoRA layer), names the parameter that replaced it (a tensor-parallel shard);
  3. trainable parameters a transform added (LoRA's adapters) join the group of the weight
     they adapt (the parameter of the same layer the user listed);
  4. frozen parameters drop out (LoRA's base); under a pipeline split, parameters of other
     stages drop out (they are trained there); any other parameter that cannot be found is an
     error naming it.

Groups keep their order and every hyperparameter. A client `torch.optim.Optimizer` built over
the model's parameters before `initialize` has its groups mapped the same way.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Iterable

import torch

WRAPPER_SEGMENTS = ("_orig_mod", "base", "module")
"""Name segments a transform inserts between a layer and its parameter (compile's
OptimizedModule, LoRA's wrapped base layer, a wrapper's `module`)."""


@dataclass
class _Entry:
    name: str
    ref: weakref.ref  # the tensor given (weak: a replaced weight is freed, and its id may be reused)

    def current(self, by_id: dict[int, torch.nn.Parameter]) -> torch.nn.Parameter | None:
        obj = self.ref()
        return obj if obj is not None and by_id.get(id(obj)) is obj else None


@dataclass
class RequestedGroups:
    """`model_parameters` (or a client optimizer's groups) as recorded before the transforms."""

    groups: list[dict]           # each: hyperparameters, and "params": list[_Entry]
    plain: bool                  # given as parameters, not group dicts: resolve to a flat list
    what: str                    # "model_parameters" or "the optimizer's param_groups", for messages
    existing: frozenset[str] = frozenset()  # every parameter name of the model given (canonical)

    @classmethod
    def capture(cls, model: torch.nn.Module, given: Iterable | None,
                what: str = "model_parameters") -> RequestedGroups | None:
        """Record `given` by the parameter names of `model` (None stays None). A generator is
        read here, once, as DeepSpeed reads it."""
        if given is None:
            return None
        if isinstance(given, torch.Tensor):
            given = [given]
        items = list(given)
        if not items:
            raise ValueError(f"initialize({what}=...) is empty: nothing to optimize; pass model.parameters() "
                             "or a list of param groups")
        names = _names(model)
        dicts = [isinstance(item, dict) for item in items]
        if any(dicts) and not all(dicts):
            raise TypeError(f"{what} mixes param-group dicts and parameters; pass either parameters "
                            "(e.g. model.parameters()) or a list of dicts each with a 'params' entry")
        plain = not any(dicts)
        raw = [{"params": items}] if plain else items
        groups = []
        for i, group in enumerate(raw):
            if "params" not in group:
                raise ValueError(f"{what}[{i}] has no 'params' entry; every param group is a dict "
                                 "{'params': [...], ...hyperparameters}")
            params = group["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            entries = [_entry(p, names, what, i, plain) for p in params]
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": entries})
        existing = frozenset(canonical(n) for n, _ in model.named_parameters(remove_duplicate=False))
        return cls(groups, plain, what, existing)

    @classmethod
    def of_optimizer(cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> RequestedGroups:
        return cls.capture(model, [dict(g) for g in optimizer.param_groups], "the optimizer's param_groups")

    def resolve(self, model: torch.nn.Module, split_stage: bool = False) -> list:
        """The groups over `model`'s trainable parameters now (a flat list when given flat)."""
        final = dict(model.named_parameters())
        by_id = {id(p): p for p in final.values()}
        by_name = {canonical(n): p for n, p in final.items()}
        placed: dict[int, int] = {}   # id(final parameter) -> group index
        out: list[list[torch.nn.Parameter]] = [[] for _ in self.groups]
        missing = []
        for gi, group in enumerate(self.groups):
            for entry in group["params"]:
                p = entry.current(by_id)
                if p is None:
                    p = by_name.get(canonical(entry.name))
                if p is None:
                    missing.append(entry.name)
                    continue
                if p.requires_grad and id(p) not in placed:
                    placed[id(p)] = gi
                    out[gi].append(p)
        if missing and not split_stage:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ValueError(f"{self.what}: {len(missing)} parameter(s) are not in the model initialize built "
                             f"(after its tensor-parallel plan, LoRA, pipeline split and compile): {shown}; pass "
                             "parameters of the model given to initialize (e.g. model.parameters())")
        self._add_derived(final, placed, out)
        if self.plain:
            return out[0]
        return [{**{k: v for k, v in g.items() if k != "params"}, "params": ps}
                for g, ps in zip(self.groups, out)]

    def _add_derived(self, final: dict, placed: dict[int, int], out: list[list]) -> None:
        """Trainable parameters a transform added (LoRA's adapters) join the group of the listed
        parameter of the same layer; those of layers the user did not list stay out."""
        layer_group: dict[str, int] = {}
        for name, p in final.items():
            if id(p) in placed:
                layer_group.setdefault(_layer(canonical(name)), placed[id(p)])
        for name, p in final.items():
            # a parameter the model had before the transforms and the user left out stays out
            if id(p) in placed or not p.requires_grad or canonical(name) in self.existing:
                continue
            layer = _layer(canonical(name))
            while layer and layer not in layer_group and not self._listed_layer(layer):
                layer = _layer(layer)
            gi = layer_group.get(layer) if layer else None
            if gi is None:
                gi = self._group_of_layer(layer)
            if gi is not None:
                placed[id(p)] = gi
                out[gi].append(p)

    def _listed_layer(self, layer: str) -> bool:
        return self._group_of_layer(layer) is not None

    def _group_of_layer(self, layer: str) -> int | None:
        for gi, group in enumerate(self.groups):
            if any(_layer(canonical(e.name)) == layer for e in group["params"]):
                return gi
        return None


def map_client_optimizer(optimizer: Any, requested: RequestedGroups | None, model: torch.nn.Module,
                         split_stage: bool) -> None:
    """Point a client optimizer's groups (recorded by `RequestedGroups.of_optimizer`) at the
    parameters of the transformed model, in place."""
    if requested is None:
        return
    for group, resolved in zip(optimizer.param_groups, requested.resolve(model, split_stage)):
        group["params"] = resolved["params"]


def canonical(name: str) -> str:
    """A parameter name read past the wrapper segments transforms insert."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def _layer(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _names(model: torch.nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def _entry(p: Any, names: dict[int, str], what: str, group: int, plain: bool) -> _Entry:
    where = what if plain else f"{what}[{group}]['params']"
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{where} holds a {type(p).__name__}, not a parameter; pass the model's parameters "
                        "(e.g. model.parameters()) or param-group dicts")
    name = names.get(id(p))
    if name is None:
        raise ValueError(f"{where} holds a tensor of shape {tuple(p.shape)} that is not a parameter of the model "
                         "given to initialize; pass that model's parameters (e.g. model.parameters())")
    return _Entry(name, weakref.ref(p))


def record_deepspeed_arguments(engine: Any, client_optimizer: bool, lr_scheduler: Any, mpu: Any, training_data: Any,
                               collate_fn: Any) -> None:
    """Keep on the engine what DeepSpeed's engine keeps of `initialize`'s arguments
    (`engine.client_optimizer`, `client_lr_scheduler`, `mpu`, `training_data`, `collate_fn`)."""
    engine.client_optimizer = engine.optimizer if client_optimizer else None
    engine.client_lr_scheduler = lr_scheduler
    engine.mpu, engine.training_data, engine.collate_fn = mpu, training_data, collate_fn
