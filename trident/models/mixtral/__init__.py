"""The Mixtral family (mixture of experts): its adapter."""

from trident.models.mixtral.adapter import MixtralAdapter
from trident.models.transformers import register_family

register_family(MixtralAdapter)

__all__ = ["MixtralAdapter"]
