"""The old path of `gpu_preset_name` (bench scripts import it from here); the GPU check's device
checks are in `trident.tools.gpu_device`."""

from trident.tools.gpu_device import gpu_preset_name

__all__ = ["gpu_preset_name"]
