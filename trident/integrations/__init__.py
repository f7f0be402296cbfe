"""trident under other libraries' training loops.

`trident.integrations.transformers.TridentTrainer` is a `transformers.Trainer` whose training
runs on trident's engine (any ZeRO stage, tensor / context parallelism) under the layout a
trident config names. `transformers` is an optional dependency (`pip install trident[hf]`);
nothing here imports it until its module is imported.
"""
