"""`deepspeed.checkpoint`: the package DeepSpeed's checkpoint helpers live in; `utils` carries the name
transformers' `save_model()` imports (`clone_tensors_for_torch_save`)."""
