"""`deepspeed.runtime.pipe`: the pipeline module's names (`PipelineModule`, `LayerSpec`, `TiedLayerSpec`)."""

from trident.deepspeed.pipe import LayerSpec, PipelineModule, ProcessTopology, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec"]
