"""Hugging Face's `"auto"` values: filled as transformers' DeepSpeed integration fills them
(public as `trident.config.fill_auto` and `trident.config.hf_auto.auto_paths`).

Configs written for the `transformers` Trainer say `"auto"` where the Trainer supplies the value
from its `TrainingArguments` (and, for bucket sizes, from the model's hidden size). The rules,
as transformers' `HfTrainerDeepSpeedConfig` applies them:

    train_micro_batch_size_per_gpu        per_device_train_batch_size
    gradient_accumulation_steps           gradient_accumulation_steps
    train_batch_size                      world_size x per_device_train_batch_size x accumulation
    gradient_clipping                     max_grad_norm
    optimizer.params.lr / betas / eps     learning_rate / [adam_beta1, adam_beta2] / adam_epsilon
    optimizer.params.weight_decay         weight_decay
    scheduler.params.warmup_min_lr        0
    scheduler.params.warmup_max_lr        learning_rate
    scheduler.params.warmup_num_steps     max(1, args.get_warmup_steps(total steps))
    scheduler.params.total_num_steps      the number of optimizer steps of the run
    fp16.enabled / bf16.enabled           fp16 or fp16_full_eval / bf16 or bf16_full_eval
                                          (also the legacy `bfloat16` section's, which transformers skips)
    zero_optimization.reduce_bucket_size  hidden_size x hidden_size
      .stage3_prefetch_bucket_size        int(0.9 x hidden_size x hidden_size)   (stage 3)
      .stage3_param_persistence_threshold 10 x hidden_size                         (stage 3)

A value that is not `"auto"` but disagrees with `TrainingArguments` is an error, as it is in
transformers. `trident.initialize` fills what it can without `TrainingArguments`
(`fill_from_run`); whatever `"auto"` is left is an error naming the key and what fills it.
"""

from __future__ import annotations

import copy
from typing import Any

from trident.config.notes import Note
from trident.config.errors import ConfigError, ConfigIssue

AUTO = "auto"

FILLED_BY: dict[str, str] = {
    "train_micro_batch_size_per_gpu": "TrainingArguments.per_device_train_batch_size",
    "gradient_accumulation_steps": "TrainingArguments.gradient_accumulation_steps",
    "train_batch_size": "world size x per_device_train_batch_size x gradient_accumulation_steps",
    "gradient_clipping": "TrainingArguments.max_grad_norm",
    "optimizer.params.lr": "TrainingArguments.learning_rate, or the lr of an optimizer passed to initialize",
    "optimizer.params.betas": "TrainingArguments.adam_beta1 and adam_beta2, or a client optimizer's betas",
    "optimizer.params.eps": "TrainingArguments.adam_epsilon, or a client optimizer's eps",
    "optimizer.params.weight_decay": "TrainingArguments.weight_decay, or a client optimizer's weight_decay",
    "scheduler.params.warmup_min_lr": "0 (fill_auto), or a client optimizer",
    "scheduler.params.warmup_max_lr": "TrainingArguments.learning_rate, or a client optimizer's lr",
    "scheduler.params.warmup_num_steps": "TrainingArguments.warmup_steps / warmup_ratio and the run's length",
    "scheduler.params.total_num_steps": "the run's number of optimizer steps (TrainingArguments.max_steps or "
                                        "fill_auto(..., num_training_steps=N))",
    "fp16.enabled": "TrainingArguments.fp16, or the model's dtype at initialize",
    "bf16.enabled": "TrainingArguments.bf16, or the model's dtype at initialize",
    "zero_optimization.reduce_bucket_size": "the model's hidden size (hidden_size^2)",
    "zero_optimization.stage3_prefetch_bucket_size": "the model's hidden size (0.9 x hidden_size^2)",
    "zero_optimization.stage3_param_persistence_threshold": "the model's hidden size (10 x hidden_size)",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "accelerate's zero3_save_16bit_model "
                                                                    "(false unless set)",
}

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
"""The schema reads `"auto"` in these as unset: the batch triangle derives them from the others."""


def _get(config: dict, path: str) -> tuple[dict | None, str]:
    node: Any = config
    *parents, leaf = path.split(".")
    for key in parents:
        node = node.get(key) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            return None, leaf
    return node, leaf


def is_auto(config: dict, path: str) -> bool:
    node, leaf = _get(config, path)
    return node is not None and node.get(leaf) == AUTO


TRIDENT_AUTO = {"tensor_parallel.plan"}
"""Keys where `"auto"` is a trident value, not a Hugging Face placeholder (the tensor-parallel
plan: the model's own, else the preset of its model type)."""


def auto_paths(config: Any, path: str = "") -> list[str]:
    """Every JSON path whose value is `"auto"` as a Hugging Face placeholder."""
    if isinstance(config, dict):
        return [p for k, v in config.items() for p in auto_paths(v, f"{path}.{k}" if path else str(k))]
    return [path] if config == AUTO and path not in TRIDENT_AUTO else []


class _Filler:
    """transformers' fill_match / fill_only: replace "auto", else record a mismatch."""

    def __init__(self, config: dict) -> None:
        self.config = config
        self.mismatches: list[ConfigIssue] = []

    def fill(self, path: str, value: Any, source: str | None = None) -> None:
        node, leaf = _get(self.config, path)
        if node is None:
            return
        if node.get(leaf) == AUTO:
            node[leaf] = value
        elif source is not None and node.get(leaf) is not None and node.get(leaf) != value:
            self.mismatches.append(ConfigIssue(path, f"{node.get(leaf)!r} disagrees with {source} = {value!r}; set "
                                                     f"it to \"auto\" or make the two agree"))


def hidden_size_of(model: Any) -> int | None:
    """The hidden size transformers reads from `model.config` (hidden_size, max(hidden_sizes), or
    the text config's); for other models a `d_model` / `hidden_size` attribute, or None."""
    config = getattr(model, "config", None)
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        if getattr(cfg, "hidden_size", None):
            return int(cfg.hidden_size)
        if getattr(cfg, "hidden_sizes", None):
            return int(max(cfg.hidden_sizes))
    for name in ("hidden_size", "d_model"):
        value = getattr(model, name, None) or getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def _fill_hidden(filler: _Filler, hidden: int | None) -> list[ConfigIssue]:
    keys = ("zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
            "zero_optimization.stage3_param_persistence_threshold")
    if not any(is_auto(filler.config, k) for k in keys):
        return []
    if hidden is None:
        return []  # left for the leftover check, which names what fills them
    filler.fill(keys[0], hidden * hidden)
    if filler.config.get("zero_optimization", {}).get("stage") == 3:
        filler.fill(keys[1], int(0.9 * hidden * hidden))
        filler.fill(keys[2], 10 * hidden)
    return []


def fill_auto(config: dict, training_args: Any, model: Any = None, num_training_steps: int | None = None) -> dict:
    """A copy of `config` with every `"auto"` filled from `training_args` (a transformers
    `TrainingArguments`, or any object with its attribute names) exactly as transformers'
    DeepSpeed integration fills it; bucket sizes from `model`'s hidden size.

    `num_training_steps` defaults to `training_args.max_steps` when that is positive. Raises
    `ConfigError` for values that disagree with `training_args` and for `"auto"` values nothing
    could fill (naming what would).
    """
    from trident.config.loader import read_json

    data = copy.deepcopy(config) if isinstance(config, dict) else read_json(config)
    a = training_args
    f = _Filler(data)
    world = int(getattr(a, "world_size", 1) or 1)
    micro, accumulation = a.per_device_train_batch_size, a.gradient_accumulation_steps
    f.fill("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size")
    f.fill("gradient_accumulation_steps", accumulation, "gradient_accumulation_steps")
    f.fill("train_batch_size", world * micro * accumulation, "world_size x per_device_train_batch_size x accumulation")
    f.fill("gradient_clipping", a.max_grad_norm, "max_grad_norm")
    f.fill("optimizer.params.lr", a.learning_rate, "learning_rate")
    f.fill("optimizer.params.betas", [a.adam_beta1, a.adam_beta2], "[adam_beta1, adam_beta2]")
    f.fill("optimizer.params.eps", a.adam_epsilon, "adam_epsilon")
    f.fill("optimizer.params.weight_decay", a.weight_decay, "weight_decay")
    f.fill("scheduler.params.warmup_min_lr", 0)
    f.fill("scheduler.params.warmup_max_lr", a.learning_rate, "learning_rate")
    f.fill("fp16.enabled", bool(a.fp16 or getattr(a, "fp16_full_eval", False)), "fp16 or fp16_full_eval")
    f.fill("bf16.enabled", bool(a.bf16 or getattr(a, "bf16_full_eval", False)), "bf16 or bf16_full_eval")
    # DeepSpeed's legacy name of the section (transformers' own tests write it); same rule
    f.fill("bfloat16.enabled", bool(a.bf16 or getattr(a, "bf16_full_eval", False)), "bf16 or bf16_full_eval")
    _fill_hidden(f, hidden_size_of(model) if model is not None else None)
    steps = num_training_steps
    if steps is None and getattr(a, "max_steps", -1) and a.max_steps > 0:
        steps = a.max_steps
    if steps is not None:
        f.fill("scheduler.params.total_num_steps", steps, "the run's number of steps")
        f.fill("scheduler.params.warmup_num_steps", max(1, a.get_warmup_steps(steps)), "warmup_steps")
    f.fill("zero_optimization.stage3_gather_16bit_weights_on_model_save", False)
    if f.mismatches:
        raise ConfigError(f.mismatches)
    return data


def fill_from_run(config: dict, model: Any = None, optimizer: Any = None, lr_scheduler: Any = None) -> dict:
    """What `trident.initialize` fills itself: the precision from the model's dtype, bucket sizes
    from its hidden size (transformers' rule; for other models the embedding width or the widest
    linear input), and optimizer/scheduler values from a client optimizer. A section a
    client object replaces is not used, so its `"auto"` values need no filling."""
    import torch

    data = copy.deepcopy(config)
    f = _Filler(data)
    if model is not None:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        f.fill("fp16.enabled", dtype == torch.float16)
        f.fill("bf16.enabled", dtype == torch.bfloat16)
        f.fill("bfloat16.enabled", dtype == torch.bfloat16)
        _fill_hidden(f, hidden_size_of(model) or _widest_input(model))
    if isinstance(optimizer, torch.optim.Optimizer) or callable(optimizer):
        data.pop("optimizer", None)
    if isinstance(optimizer, torch.optim.Optimizer):
        group = optimizer.param_groups[0]
        f.fill("scheduler.params.warmup_min_lr", 0)
        f.fill("scheduler.params.warmup_max_lr", group.get("lr"))
    if lr_scheduler is not None:
        data.pop("scheduler", None)
    return data


def _widest_input(model: Any) -> int | None:
    """A hidden size for a model without a transformers config: its embedding width, else the
    widest input of its linear layers."""
    import torch

    dims = [m.embedding_dim for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    dims = dims or [m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return max(dims) if dims else None


def leftover_auto_issues(data: dict, notes: list[Note]) -> list[ConfigIssue]:
    """One issue per `"auto"` still in `data` (batch sizes aside), naming what fills it; the
    values are removed so the schema does not report them again. An `"auto"` on a key no rule
    fills (DeepSpeed's inference configs write some) means the default, noted in `notes`."""
    issues = []
    if all(data.get(k, AUTO) == AUTO for k in BATCH_KEYS[:2]) and data.get(BATCH_KEYS[1]) == AUTO:
        # the triangle needs the per-rank or the global batch; with both "auto" nothing here gives them
        issues.append(ConfigIssue(BATCH_KEYS[1], f'"auto" (and train_batch_size is "auto" or unset): it is filled '
                                                 f"from {FILLED_BY[BATCH_KEYS[1]]}: call trident.config.fill_auto("
                                                 "config, training_args) first, or give a value"))
    zero = data.get("zero_optimization")
    stage = zero.get("stage") if isinstance(zero, dict) else 0
    for path in auto_paths(data):
        if path in BATCH_KEYS:
            continue
        node, leaf = _get(data, path)
        del node[leaf]
        if path.startswith("zero_optimization.stage3_") and stage != 3:
            continue  # no effect below stage 3, where transformers leaves them "auto" too
        if path not in FILLED_BY:
            notes.append(Note(path, "ignored", '"auto" that no rule fills; the default applies'))
            continue
        what = FILLED_BY[path]
        issues.append(ConfigIssue(path, f'"auto" is a Hugging Face placeholder still unfilled; it is filled from '
                                        f"{what}: call trident.config.fill_auto(config, training_args) first, or "
                                        "give a value"))
    return issues
