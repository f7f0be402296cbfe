"""DeepSpeed's face of the engine (layer 8, beside `trident.engine`): `api.DeepSpeedEngineAPI`,
the DeepSpeed methods `Engine` inherits (with `settings`' config accessors and `attributes`), with
the checkpoint importers `load_checkpoint` uses; `pipe_api`, the pipeline engine's DeepSpeed names;
`surface`, DeepSpeed's whole public surface as data; `loader`, DeepSpeed's data order;
`mpu.mesh_from_mpu`, what `initialize(mpu=...)` takes from Megatron's model-parallel unit."""

from trident.deepspeed.engine.api import DeepSpeedEngineAPI, register_checkpoint_importer
from trident.deepspeed.engine.mpu import mesh_from_mpu

__all__ = ["DeepSpeedEngineAPI", "mesh_from_mpu", "register_checkpoint_importer"]
