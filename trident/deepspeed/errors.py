"""trident's named errors for DeepSpeed names it has no counterpart of.

`NotInTrident` (a missing attribute) lives with the engine surface; a missing *module* is
`NotInTridentModule`, a `ModuleNotFoundError` so that optional-import probes
(`try: import deepspeed.x except ImportError`) in transformers / accelerate keep working --
it cannot also be a `NotInTrident`: AttributeError and ImportError have conflicting layouts."""

from trident.deepspeed.engine.surface import NotInTrident


class NotInTridentModule(ModuleNotFoundError):
    """A DeepSpeed module trident does not stand in for; the message names it and what to use."""


__all__ = ["NotInTrident", "NotInTridentModule"]
