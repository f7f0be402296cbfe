"""`deepspeed.runtime.zero`: `Init`, `GatheredParameters`, `TiledLinear` (trident.zero's)."""

from trident.zero import GatheredParameters, Init, TiledLinear

__all__ = ["GatheredParameters", "Init", "TiledLinear"]
