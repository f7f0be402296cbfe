"""`trident checkpoint merge-lora`: a checkpoint's LoRA adapters folded into its weights, written out.

The checkpoint's manifest records the adapters' rank and alpha under `lora` (written at save
time from `trident.peft.merge.lora_record`); its whole fp32 state dict is merged by
`trident.peft.merge.merge_lora_state_dict` and written as one safetensors file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trident.checkpointing.consolidate import (checkpoint_folder, get_fp32_state_dict_from_zero_checkpoint,
                                               write_state_dict)
from trident.checkpointing.state import read_manifest
from trident.peft.merge import A, adapter_paths, merge_lora_state_dict


@dataclass(frozen=True)
class LoRARecord:
    """What a checkpoint must record to be merged: the adapters' rank and alpha."""

    r: int
    alpha: float

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


def recorded_lora(manifest: dict) -> LoRARecord | None:
    """The `lora` entry a checkpoint's manifest records (r and alpha of its LoRA layers at save time)."""
    entry = manifest.get("lora")
    if entry is None:
        return None
    r, alpha = entry.get("r"), entry.get("alpha")
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0 or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"the manifest's lora entry {entry!r} needs a positive integer r and a positive alpha")
    return LoRARecord(r, float(alpha))


def merge_lora_checkpoint(checkpoint_dir, out, tag: str | None = None,
                          scaling: float | None = None) -> tuple[Path, str]:
    """Write a checkpoint's merged model to `out`/model.safetensors (atomically); returns the file
    and a one-line summary. `scaling` replaces alpha / r from the manifest (needed only where the
    manifest records none)."""
    folder = checkpoint_folder(checkpoint_dir, tag)
    record = recorded_lora(read_manifest(folder))
    state = get_fp32_state_dict_from_zero_checkpoint(folder)
    paths = adapter_paths(state)
    if not paths:
        raise ValueError(f"{folder}: no LoRA adapters in this checkpoint (no '<path>{A}' tensors); nothing to merge. "
                         "`trident checkpoint consolidate` writes its weights as they are")
    from_record = scaling is None
    if from_record:
        if record is None:
            raise ValueError(f"{folder}: has {len(paths)} LoRA adapters but its manifest records no `lora` entry "
                             "(r, alpha), so the scaling alpha / r is unknown (saved by a trident that did not "
                             "record it, or its layers differ in r or alpha). Pass --scaling ALPHA_OVER_R")
        scaling = record.scaling
    merged = merge_lora_state_dict(state, scaling)
    out_file = Path(out) / "model.safetensors"
    write_state_dict(merged, out_file)
    unique = {id(t): t.numel() for t in merged.values()}  # a tied tensor is written once
    origin = f"r={record.r}, alpha={record.alpha:g}, " if from_record else ""
    summary = (f"merged {len(paths)} LoRA layers ({origin}scaling {scaling:g}) into {out_file}: "
               f"{len(unique)} tensors, {sum(unique.values()):,} elements, fp32")
    return out_file, summary
