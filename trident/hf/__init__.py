"""Hugging Face `transformers` models under every layout: loading and export.

- `from_pretrained(folder, mesh=..., config=...)`: a local safetensors checkpoint (one file,
  or shards with `model.safetensors.index.json`) read straight into each rank's ZeRO-3
  partition or tensor-parallel shard, reading only the bytes that rank keeps; the model is
  built on the meta device and is ready for `trident.initialize` with the same config.
- `save_pretrained(engine, out)` (`engine.save_pretrained`) and `export_checkpoint(ckpt, out)`
  (`trident checkpoint export-hf`): `config.json` plus `model-0000x-of-0000y.safetensors` and
  `model.safetensors.index.json`, from any layout, that `AutoModelForCausalLM.from_pretrained`
  reads without trident. What to write about a model comes from its family's `ModelAdapter`
  (trident.models.transformers).
- `peft_export.save_adapters` (`trident.peft.save_adapters`, `engine.save_adapters`): LoRA
  adapters in peft's format.
- Under `trident.zero.Init`, a transformers model's own weight initialisation (`_init_weights`
  in `post_init`) runs on whole tensors, one module at a time (`trident.hf.zero_init`, which
  registers itself with `zero.Init` here).

Nothing here imports `transformers` until it is used.
"""

from trident.hf import peft_export, zero_init
from trident.hf.export import export_checkpoint, save_pretrained
from trident.hf.load import LoadError, from_pretrained

__all__ = ["LoadError", "export_checkpoint", "from_pretrained", "peft_export", "save_pretrained", "zero_init"]
