"""`deepspeed.runtime`: the modules DeepSpeed scripts import from it, over trident's own.

`utils` (`set_random_seed`, `see_memory_usage`), `dataloader` (`RepeatingLoader`,
`DeepSpeedDataLoader`), `engine` (`DeepSpeedEngine`), `pipe` (`PipelineModule`, `LayerSpec`,
`TiedLayerSpec`, `PipelineEngine`, topology), `lr_schedules` (DeepSpeed's schedulers),
`activation_checkpointing.checkpointing`, `zero` (`Init`, `GatheredParameters`), `config`
(`DeepSpeedConfigError`). Importing this package imports none of them (each is loaded when named).
"""
