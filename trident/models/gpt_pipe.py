"""The reference GPT as a `PipelineModule`: `trident.models.gpt.pipe`, under its public path."""

from trident.models.gpt.pipe import (gpt_layers, gpt_names, gpt_pipe, gpt_shard_specs, gpt_state_dict,
                                     load_gpt_state_dict)

__all__ = ["gpt_layers", "gpt_names", "gpt_pipe", "gpt_shard_specs", "gpt_state_dict", "load_gpt_state_dict"]
