"""The OLMo family: its adapter (the worked example of docs/models.md)."""

from trident.models.olmo.adapter import OlmoAdapter
from trident.models.transformers import register_family

register_family(OlmoAdapter)

__all__ = ["OlmoAdapter"]
