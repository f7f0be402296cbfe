"""Hugging Face's `"auto"` values at their public path (`trident.config.fill_auto`).

The rules are the Hugging Face Trainer's side of DeepSpeed's dialect and live with it, in
`trident.deepspeed.config.hf_auto`; these names reach them through the registered dialect
(`trident.config.dialect`), so config never imports the dialect.
"""

from __future__ import annotations

from typing import Any

from trident.config.dialect import registered_dialect


def fill_auto(config: dict, training_args: Any, model: Any = None, num_training_steps: int | None = None) -> dict:
    """A copy of `config` with every `"auto"` filled from `training_args` as transformers'
    DeepSpeed integration fills it (`trident.deepspeed.config.hf_auto.fill_auto` says how)."""
    return registered_dialect().fill_auto(config, training_args, model=model, num_training_steps=num_training_steps)


def auto_paths(config: Any, path: str = "") -> list[str]:
    """Every JSON path (under `path`) whose value is `"auto"` as a Hugging Face placeholder."""
    return registered_dialect().auto_paths(config, path)
