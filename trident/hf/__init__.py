"""Hugging Face `transformers` models under every layout: loading and export.

- `from_pretrained(folder, mesh=..., config=...)`: a local safetensors checkpoint (one file,
  or shards with `model.safetensors.index.json`) read straight into each rank's ZeRO-3
  partition or tensor-parallel shard, reading only the bytes that rank keeps; the model is
  built on the meta device and is ready for `trident.initialize` with the same config.
- `save_pretrained(engine, out)` (`engine.save_pretrained`) and `export_checkpoint(ckpt, out)`
  (`trident checkpoint export-hf`): `config.json` plus `model-0000x-of-0000y.safetensors` and
  `model.safetensors.index.json`, from any layout, that `AutoModelForCausalLM.from_pretrained`
  reads without trident.
- Under `trident.zero.Init`, a transformers model's own weight initialisation (`_init_weights`
  in `post_init`) runs on whole tensors, one module at a time (`trident.hf.zero_init`).

Nothing here imports `transformers` until it is used.
"""

from trident.hf.export import export_checkpoint, save_pretrained
from trident.hf.load import LoadError, from_pretrained

__all__ = ["LoadError", "export_checkpoint", "from_pretrained", "save_pretrained"]
