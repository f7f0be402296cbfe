"""Write trident's LoRA adapters in peft's format, so `PeftModel.from_pretrained(base, dir)` loads them.

peft's adapter directory holds two files:

    adapter_model.safetensors   base_model.model.<module>.lora_A.weight   (r x in)
                                base_model.model.<module>.lora_B.weight   (out x r)
                                base_model.model.<module>.base_layer.bias (bias "lora_only" or "all")
                                base_model.model.<module>.<tensor>        (modules_to_save, whole)
    adapter_config.json         peft_type "LORA", r, lora_alpha, lora_dropout, target_modules, ...

`<module>` is the layer's path inside the model peft wraps (a transformers PreTrainedModel).
trident names the same tensors `<module>.lora_A`, `<module>.lora_B` and `<module>.base.bias`.
When the engine's model wraps the transformers model (e.g. a small module returning `.loss`),
the paths start at the outermost PreTrainedModel inside it; `prefix` names that submodule
explicitly (`""` for the whole model).

What the file states is read off the model itself: r, alpha and dropout from the `LoRALinear`
layers, `target_modules` as the adapted layers' last names (their full paths where those would
catch more layers), `modules_to_save` as the outermost other modules that train in full, and
`bias` from which biases train. Tensors are written whole and in the compute dtype: ZeRO-3
shards are gathered over dp, tensor-parallel slices all-gathered over tp and merged by their
`tp_spec` (stride and vocabulary padding undone).

It lives above the engine (it writes from an engine's layout) and registers itself as
`trident.peft.save_adapters` (`trident.peft.export.register_adapter_writer`) when imported, which
`import trident` does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from torch import nn

from trident.comm import collectives
from trident.engine.engine import Engine
from trident.hf.export import export_root
from trident.peft.export import register_adapter_writer
from trident.peft.lora import LoRALinear
from trident.engine.full_state import whole_tensors

WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"
PEFT_PREFIX = "base_model.model."


def save_adapters(engine_or_module, save_dir: str | os.PathLike, base_model_name_or_path: str | None = None, *,
                  prefix: str | None = None, task_type: str | None = None) -> Path:
    """Write the model's LoRA adapters to `save_dir` as peft does; returns the directory.

    Collective for an engine (every rank calls it; mesh rank 0 writes, each file atomically,
    the config last). A plain module must hold whole tensors and is written by the caller's
    process. `base_model_name_or_path` defaults to the transformers model's `name_or_path`;
    `task_type` (e.g. "CAUSAL_LM") picks the PeftModel subclass `from_pretrained` builds.
    """
    from safetensors.torch import save_file

    engine = engine_or_module if isinstance(engine_or_module, Engine) else None
    model = engine.module if engine is not None else engine_or_module
    mesh = engine.mesh if engine is not None else None
    if mesh is not None and mesh.pp_size > 1:
        raise ValueError(f"save_adapters: pipeline parallelism (pipeline.stages = {mesh.pp_size}) spreads the "
                         "layers over stages under pipeline names; save a checkpoint and export from one process")
    if engine is not None and engine.config.lora is not None and engine.config.lora.init == "pissa":
        raise ValueError("save_adapters: lora.init 'pissa' changed the frozen weights (W - scaling B0 A0), so the "
                         "adapters do not apply to the original base model; merge them into the weights instead")
    root_name = _peft_root(model, prefix)
    root = model.get_submodule(root_name) if root_name else model
    adapted = _adapted_layers(model, root, root_name)
    if engine is None and any(hasattr(p, "_trident_shard") or hasattr(p, "_trident_zero") for p in root.parameters()):
        raise ValueError("save_adapters: the module's parameters are ZeRO-3 partitions; pass the engine")
    saved, biases = _trainable_rest(root, adapted)
    plan = _export_plan(root, adapted, saved, biases)
    tensors = whole_tensors(root, list(plan), mesh)
    if engine is None or engine.ranks.writer:
        out = Path(save_dir)
        out.mkdir(parents=True, exist_ok=True)
        weights = {plan[name]: t.contiguous() for name, t in tensors.items()}
        config = _peft_config(root, adapted, saved, biases, base_model_name_or_path, task_type)
        _replace(out / WEIGHTS_NAME, lambda tmp: save_file(weights, str(tmp), metadata={"format": "pt"}))
        _replace(out / CONFIG_NAME, lambda tmp: tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n"))
    if engine is not None and engine.ranks.group is not None:
        collectives.barrier(group=engine.ranks.group)
    return Path(save_dir)


def _replace(path: Path, write) -> None:
    """Write through a temporary file beside `path`, then rename it: readers see all or nothing."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def _peft_root(model: nn.Module, prefix: str | None) -> str:
    """The path of the module peft wraps: `prefix`, else the model the family's adapter exports (the
    outermost transformers PreTrainedModel inside `model`), else ""."""
    if prefix is not None:
        if prefix:
            model.get_submodule(prefix)  # a wrong prefix fails here, naming the missing attribute
        return prefix
    found = export_root(model)
    return found[0] if found is not None else ""


def _adapted_layers(model: nn.Module, root: nn.Module, root_name: str) -> dict[str, LoRALinear]:
    """The LoRALinear layers by path inside `root`; refuses a model without any, or with some outside."""
    everywhere = [n for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    if not everywhere:
        peft = any(hasattr(m, "peft_config") for m in model.modules())
        hint = (" It holds a peft model: save that with its own save_pretrained()" if peft
                else " Add a `lora` section to the config, or call trident.peft.apply_lora")
        raise ValueError(f"save_adapters: the model has no trident LoRA adapters (LoRALinear layers).{hint}")
    outside = [n for n in everywhere if root_name and not n.startswith(root_name + ".")]
    if outside:
        raise ValueError(f"save_adapters: adapter {outside[0]!r} lies outside {root_name!r}, the module peft would "
                         "wrap; pass prefix= naming the module that holds every adapter")
    adapted = {n: m for n, m in root.named_modules() if isinstance(m, LoRALinear)}
    ranks = {(m.r, m.alpha) for m in adapted.values()}
    if len(ranks) > 1:
        raise ValueError(f"save_adapters: the adapters have different (r, alpha): {sorted(ranks)}; peft's file "
                         "states one of each here")
    return adapted


def _export_plan(root: nn.Module, adapted: dict[str, LoRALinear], saved: list[str],
                 biases: list[str]) -> dict[str, str]:
    """trident state-dict name (inside `root`) -> peft key, for every tensor the adapter file holds."""
    plan = {}
    for path in adapted:
        plan[f"{path}.lora_A"] = f"{PEFT_PREFIX}{path}.lora_A.weight"
        plan[f"{path}.lora_B"] = f"{PEFT_PREFIX}{path}.lora_B.weight"
    state = root.state_dict(keep_vars=True)
    for module in saved:
        for k in root.get_submodule(module).state_dict():
            plan[f"{module}.{k}"] = f"{PEFT_PREFIX}{module}.{k}"
    for name in biases:
        plan[name] = PEFT_PREFIX + _peft_name(name, adapted)
    missing = [n for n in plan if n not in state]
    if missing:
        raise ValueError(f"save_adapters: {missing[0]!r} is not in the model's state dict")
    return plan


def _peft_name(name: str, adapted: dict[str, LoRALinear]) -> str:
    """peft calls a LoRA layer's wrapped layer `base_layer`; trident calls it `base`."""
    path, _, tail = name.rpartition(".base.")
    return f"{path}.base_layer.{tail}" if path in adapted and "." not in tail else name


def _trainable_rest(root: nn.Module, adapted: dict[str, LoRALinear]) -> tuple[list[str], list[str]]:
    """The trainable tensors besides the adapters: (modules trained whole, trainable bias names).

    A module counts as trained whole when every parameter of it trains and one is not a bias;
    the outermost such modules are peft's `modules_to_save`. What is left must be biases."""
    inside = lambda n: any(n == p or n.startswith(p + ".") for p in adapted)  # noqa: E731
    trainable = {n for n, p in root.named_parameters() if p.requires_grad}
    rest = trainable - {f"{p}.lora_{x}" for p in adapted for x in "AB"}
    saved: list[str] = []
    for name, module in root.named_modules():
        if not name or inside(name) or any(name.startswith(s + ".") for s in saved):
            continue
        own = [f"{name}.{k}" for k, _ in module.named_parameters()]
        if own and all(n in rest for n in own) and any(not n.endswith("bias") for n in own):
            saved.append(name)
    covered = {n for n in rest if any(n.startswith(s + ".") for s in saved)}
    biases = sorted(rest - covered)
    odd = [n for n in biases if not n.endswith("bias")]
    if odd:
        raise ValueError(f"save_adapters: {odd[0]!r} trains but is neither an adapter, a bias, nor part of a module "
                         "trained whole; peft's format has no place for it")
    return saved, biases


def _bias_mode(root: nn.Module, adapted: dict[str, LoRALinear], saved: list[str], biases: list[str]) -> str:
    if not biases:
        return "none"
    lora_biases = sorted(f"{p}.base.bias" for p, m in adapted.items() if getattr(m.base, "bias", None) is not None)
    if biases == lora_biases:
        return "lora_only"
    every = sorted(n for n, _ in root.named_parameters()
                   if n.endswith("bias") and not any(n.startswith(s + ".") for s in saved))
    if biases == every:
        return "all"
    raise ValueError(f"save_adapters: the trainable biases ({biases[:3]}...) are neither those of the adapted layers "
                     "(peft bias 'lora_only') nor all of them ('all')")


def _target_modules(root: nn.Module, adapted: dict[str, LoRALinear]) -> list[str]:
    """The adapted layers' last names, if peft's rule (equal, or ending in '.' + name) picks out
    exactly these layers of the original model; their full paths otherwise."""
    under_lora = lambda n: any(n.startswith(p + ".") for p in adapted)  # noqa: E731
    names = [n for n, _ in root.named_modules() if n and not under_lora(n)]
    suffixes = sorted({p.rpartition(".")[2] for p in adapted})
    caught = {n for n in names if any(n == s or n.endswith("." + s) for s in suffixes)}
    return suffixes if caught == set(adapted) else sorted(adapted)


def _peft_config(root: nn.Module, adapted: dict[str, LoRALinear], saved: list[str], biases: list[str],
                 base_model_name_or_path: str | None, task_type: str | None) -> dict:
    """adapter_config.json: the keys every peft since 0.13 reads for LoRA (the rest take peft's defaults)."""
    layer = next(iter(adapted.values()))
    if base_model_name_or_path is None:
        base_model_name_or_path = getattr(getattr(root, "config", None), "name_or_path", None) or None
    dropout = layer.dropout.p if isinstance(layer.dropout, nn.Dropout) else 0.0
    alpha = int(layer.alpha) if float(layer.alpha).is_integer() else layer.alpha
    return {
        "peft_type": "LORA", "task_type": task_type, "base_model_name_or_path": base_model_name_or_path,
        "revision": None, "inference_mode": True,
        "r": layer.r, "lora_alpha": alpha, "lora_dropout": dropout,
        "target_modules": _target_modules(root, adapted), "modules_to_save": saved or None,
        "bias": _bias_mode(root, adapted, saved, biases),
        "fan_in_fan_out": False, "init_lora_weights": True, "use_rslora": False, "use_dora": False,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
    }


register_adapter_writer(save_adapters)
