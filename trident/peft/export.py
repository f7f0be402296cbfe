"""`save_adapters`: trident's LoRA adapters written in peft's format (`PeftModel.from_pretrained` reads them).

The writer gathers whole tensors from an engine's layout (ZeRO-3 partitions, tensor-parallel
slices), so it lives above the engine, in `trident.hf.peft_export`; it registers itself here when
imported (`import trident` imports it), so `trident.peft.save_adapters` and `engine.save_adapters`
reach it without `peft` importing the engine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

_WRITER: list[Callable[..., Path]] = []


def register_adapter_writer(writer: Callable[..., Path]) -> None:
    """Make `writer` (trident.hf.peft_export.save_adapters) what `save_adapters` calls."""
    _WRITER[:] = [writer]


def save_adapters(engine_or_module, save_dir: str | os.PathLike, base_model_name_or_path: str | None = None,
                  **kwargs: Any) -> Path:
    """Write the model's LoRA adapters to `save_dir` as peft does; returns the directory.

    Collective for an engine (every rank calls it; mesh rank 0 writes). A plain module must hold
    whole tensors. Keyword arguments: `prefix` (the module peft wraps; default the transformers
    model inside) and `task_type` (e.g. "CAUSAL_LM"). See `trident.hf.peft_export.save_adapters`.
    """
    if not _WRITER:
        raise RuntimeError("trident.peft.save_adapters: no adapter writer is registered; import trident (it "
                           "registers trident.hf.peft_export's) before saving adapters")
    return _WRITER[0](engine_or_module, save_dir, base_model_name_or_path, **kwargs)
