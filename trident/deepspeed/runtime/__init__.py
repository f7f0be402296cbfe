"""`deepspeed.runtime`: the modules DeepSpeed scripts import from it, over trident's own.

`utils` (`set_random_seed`, `see_memory_usage`), `dataloader` (`RepeatingLoader`,
`DeepSpeedDataLoader`), `engine` (`DeepSpeedEngine`), `pipe` (`PipelineModule`, `LayerSpec`,
`TiedLayerSpec`, `PipelineEngine`, topology), `lr_schedules` (DeepSpeed's schedulers),
`activation_checkpointing.checkpointing`, `zero` (`Init`, `GatheredParameters`), `config`
(`DeepSpeedConfigError`). Importing this package imports none of them (each is loaded when named).
"""

import importlib as _importlib

_SUBMODULES = ("utils", "dataloader", "engine", "pipe", "lr_schedules", "activation_checkpointing", "zero",
               "config")


def __getattr__(name: str):
    """`deepspeed.runtime.utils.set_random_seed(...)` after a bare `import deepspeed`: DeepSpeed imports its
    submodules eagerly, so scripts reach them as attributes; here each is imported when first named."""
    if name in _SUBMODULES:
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
