"""DeepSpeed's face of the engine (layer 8, beside `trident.engine`): `api.DeepSpeedEngineAPI`,
the DeepSpeed methods `Engine` inherits, with the checkpoint importers `load_checkpoint` uses;
`mpu.mesh_from_mpu`, what `initialize(mpu=...)` takes from Megatron's model-parallel unit."""

from trident.deepspeed.engine.api import DeepSpeedEngineAPI, register_checkpoint_importer
from trident.deepspeed.engine.mpu import mesh_from_mpu

__all__ = ["DeepSpeedEngineAPI", "mesh_from_mpu", "register_checkpoint_importer"]
