"""Checkpoints: atomic sharded save/load with a manifest (`state`), offline consolidation
(`consolidate`)."""

from trident.checkpointing.consolidate import (get_fp32_state_dict_from_zero_checkpoint,
                                               load_state_dict_from_zero_checkpoint)

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint"]
