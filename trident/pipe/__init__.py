"""`deepspeed.pipe`'s names, as `import trident as deepspeed` finds them (`trident.deepspeed.pipe`)."""

from trident.deepspeed.pipe import LayerSpec, PipelineModule, ProcessTopology, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec", "ProcessTopology"]
