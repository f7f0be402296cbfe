"""`deepspeed.runtime.zero.partition_parameters`: `Init` and `GatheredParameters`."""

from trident.zero import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init"]
