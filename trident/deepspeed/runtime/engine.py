"""`deepspeed.runtime.engine`: `DeepSpeedEngine` is trident's `Engine` (what `initialize` returns)."""

from trident.engine.engine import Engine as DeepSpeedEngine

ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER, MUON_OPTIMIZER = "adam", "adamw", "lamb", "muon"

__all__ = ["DeepSpeedEngine", "ADAM_OPTIMIZER", "ADAMW_OPTIMIZER", "LAMB_OPTIMIZER", "MUON_OPTIMIZER"]
