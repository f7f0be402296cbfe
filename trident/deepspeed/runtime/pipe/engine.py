"""`deepspeed.runtime.pipe.engine`: `PipelineEngine` (what `initialize` returns for a PipelineModule)."""

from trident.engine.pipeline_engine import PipelineEngine

__all__ = ["PipelineEngine"]
