"""`deepspeed.utils.zero_to_fp32`: a checkpoint's whole fp32 weights, whatever layout saved it.

The functions read trident checkpoints (`trident.checkpointing.consolidate`) and DeepSpeed
checkpoints alike: a DeepSpeed checkpoint folder is converted in memory first
(`trident.deepspeed.checkpoint`), with DeepSpeed's argument names.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trident.checkpointing import consolidate
import trident.deepspeed.checkpoint as deepspeed_checkpoint

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_zero_checkpoint"]


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | Path, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
    """The model's state dict in fp32, from a trident or a DeepSpeed checkpoint folder."""
    if deepspeed_checkpoint.is_deepspeed_checkpoint(checkpoint_dir, tag):
        return deepspeed_checkpoint.read_deepspeed(checkpoint_dir, tag).fp32_state_dict(exclude_frozen_parameters)
    return consolidate.get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str | Path,
                                         tag: str | None = None) -> torch.nn.Module:
    """Load the fp32 weights into a plain model (on CPU) and return it."""
    model = model.cpu()
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag), strict=False)
    return model


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | Path, output_file: str | Path,
                                               tag: str | None = None, exclude_frozen_parameters: bool = False,
                                               **unused: object) -> Path:
    """Write the fp32 state dict to `output_file` (.bin/.pt/.pth: torch.save; else safetensors)."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    out = Path(output_file)
    if out.is_dir():
        out = out / "pytorch_model.bin"
    consolidate.write_state_dict(state, out)
    return out
