"""`deepspeed.runtime.pipe.module`: `PipelineModule`, `LayerSpec`, `TiedLayerSpec`."""

from trident.deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
