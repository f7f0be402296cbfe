"""DeepSpeed's face, in one package: what a DeepSpeed script or config meets in trident.

- `config`: DeepSpeed's config dialect and Hugging Face's `"auto"` values, translated into
  trident's own sections (registered with `trident.config.loader` when imported; layer 0);
- `comm`: `deepspeed.comm`'s names and signatures over trident's collectives (layer 1);
- `engine`: DeepSpeed's engine API as mixins `trident.engine.engine.Engine` and the pipeline
  engine inherit (`api`, `settings`, `attributes`, `pipe_api`), `surface` (every public name of
  DeepSpeed's engines and package, as data, with what trident does with each), `loader`
  (DeepSpeed's data order), and `initialize(mpu=...)`'s Megatron groups (layer 8);
- `pipe`, `ops`, `utils`, `accelerator`, `runtime`: the module surface (`deepspeed.pipe`,
  `deepspeed.ops.adam`, `deepspeed.utils`, `get_accelerator()`, `deepspeed.runtime.*`), `package`
  (the `deepspeed` package's own names, re-exported by `trident`), `hook` (the finder that makes
  `import deepspeed` resolve to trident: `install_as_deepspeed`, `trident launch --as-deepspeed`),
  and `checkpoint`: DeepSpeed checkpoints read and imported (layer 9).

Users keep writing `import trident as deepspeed`: `trident/__init__.py` re-exports the surface,
and `trident.comm`, `trident.pipe`, `trident.ops`, `trident.utils` keep their names. This file
imports nothing: its submodules sit on different layers.
"""
