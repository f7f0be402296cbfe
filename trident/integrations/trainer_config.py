"""The trident config a `TridentTrainer` runs, from the user's config and the `TrainingArguments`.

Every `"auto"` is filled from the arguments (`trident.config.fill_auto`); keys the Trainer always
decides count as `"auto"` when the config leaves them out; `TrainingArguments.fsdp` names a ZeRO
stage the config must agree with. Nothing here imports transformers.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch.distributed as dist

from trident.config import ConfigError, ConfigIssue, fill_auto
from trident.config.loader import read_json

TRAINER_DECIDES = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping")
"""Top-level keys the `TrainingArguments` always set: absent from the config means `"auto"`."""


class ArgsView:
    """`TrainingArguments` as `fill_auto` should see them: the world is the data-parallel size
    (tp / cp / pp ranks of a replica share their batch)."""

    def __init__(self, args: Any, world_size: int) -> None:
        self._args = args
        self.world_size = world_size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._args, name)


def fsdp_stage(args: Any) -> int | None:
    """The ZeRO stage `TrainingArguments.fsdp` names, or None when it names none."""
    fsdp = getattr(args, "fsdp", None)
    if not fsdp:
        return None
    text = " ".join(str(getattr(o, "value", o)) for o in fsdp) if isinstance(fsdp, (list, tuple)) else str(fsdp)
    if "full_shard" in text or "hybrid_shard" in text:
        return 3
    if "shard_grad_op" in text:
        return 2
    return None


def trident_config_for(config: str | dict, args: Any, model: Any = None, data_parallel_size: int = 1,
                       num_training_steps: int | None = None) -> dict:
    """The trident config a `TridentTrainer` runs: `config` (a path or dict) with the keys the
    Trainer decides defaulted to `"auto"`, the ZeRO stage checked against `args.fsdp`, and every
    `"auto"` filled from `args` by `trident.config.fill_auto` (the batch from
    `data_parallel_size` ranks). Raises `ConfigError` listing every value that disagrees."""
    data = copy.deepcopy(config) if isinstance(config, dict) else read_json(config)
    for key in TRAINER_DECIDES:
        data.setdefault(key, "auto")
    for section in ("fp16", "bf16"):
        if isinstance(data.setdefault(section, {}), dict):
            data[section].setdefault("enabled", "auto")
    data.setdefault("seed", args.seed)
    issues = []
    wanted = fsdp_stage(args)
    zero = data.setdefault("zero_optimization", {})
    if wanted is not None and isinstance(zero, dict):
        stage = zero.get("stage", 0)
        if stage == "auto":
            zero["stage"] = wanted
        elif stage != wanted:
            issues.append(ConfigIssue("zero_optimization.stage", (
                f"{stage!r} disagrees with TrainingArguments.fsdp = {args.fsdp!r} (ZeRO stage {wanted}); set it to "
                "\"auto\" or make the two agree")))
    elif isinstance(zero, dict) and zero.get("stage") == "auto":
        zero["stage"] = 0  # TrainingArguments without fsdp: no sharding asked for
    try:
        data = fill_auto(data, ArgsView(args, data_parallel_size), model=model, num_training_steps=num_training_steps)
    except ConfigError as e:
        issues.extend(e.issues)
    if issues:
        raise ConfigError(issues)
    return data


def layout_sizes(data: dict) -> dict[str, int]:
    def size(section: str, key: str = "size") -> int:
        value = data.get(section, {})
        value = value.get(key, 1) if isinstance(value, dict) else 1
        return int(value) if isinstance(value, int) else 1
    return {"pp": size("pipeline", "stages"), "tp": size("tensor_parallel"), "cp": size("context_parallel"),
            "ep": size("expert_parallel")}


def world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def guess_dp(data: dict) -> int:
    """Ranks reading different samples, before there is a mesh: the world over pp x tp x cp."""
    sizes = layout_sizes(data)
    return max(1, world_size() // (sizes["pp"] * sizes["tp"] * sizes["cp"]))
