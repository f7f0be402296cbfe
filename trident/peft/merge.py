"""Fold LoRA adapters into plain weights, on a state dict: what `trident checkpoint merge-lora` writes.

`apply_lora` renames each adapted layer's tensors: `<path>.weight` becomes `<path>.base.weight`
next to `<path>.lora_A` (r x in) and `<path>.lora_B` (out x r). Merging computes

    <path>.weight = <path>.base.weight + scaling * <path>.lora_B @ <path>.lora_A

moves every other `<path>.base.<x>` (the bias) back to `<path>.<x>` and drops the adapters, so
the result loads into the model as it was before `apply_lora`. The state dict must be whole
(tp slices merged, as `get_fp32_state_dict_from_zero_checkpoint` gives it); `merge_lora` does
the same on a live model. scaling = alpha / r, which a checkpoint's manifest records under
`lora` (`lora_record`, written at save time).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

A, B, BASE = ".lora_A", ".lora_B", ".base."


@dataclass(frozen=True)
class LoRARecord:
    """What a checkpoint must record to be merged: the adapters' rank and alpha."""

    r: int
    alpha: float

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


def adapter_paths(state: dict[str, torch.Tensor]) -> list[str]:
    """Module paths of the adapted layers in `state` (those with a `<path>.lora_A`)."""
    return sorted(k[:-len(A)] for k in state if k.endswith(A))


@torch.no_grad()
def merge_lora_state_dict(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """`state` with every adapter folded into its base weight (see the module docstring).

    The product is computed in fp32 (float64 for float64 weights) and stored in the base
    weight's dtype; tensors of layers without adapters are passed through unchanged (a tied
    alias stays the same tensor as its original).
    """
    paths = adapter_paths(state)
    if not paths:
        raise ValueError(f"no LoRA adapters in this state dict (no '<path>{A}' entries among its {len(state)} "
                         "tensors); nothing to merge")
    for path in paths:
        for need in (f"{path}{B}", f"{path}{BASE}weight"):
            if need not in state:
                raise ValueError(f"LoRA layer {path!r} has {path}{A} but no {need}; the state dict is incomplete")
    adapted = {f"{p}{suffix}" for p in paths for suffix in (A, B)}
    owner = {f"{p}{BASE}": p for p in paths}
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name in adapted:
            continue
        prefix = name[:name.rfind(".") + 1]
        path = owner.get(prefix)
        if path is None:
            out[name] = t
            continue
        field = name[len(prefix):]
        if field == "weight":
            a, b = state[f"{path}{A}"], state[f"{path}{B}"]
            work = torch.float64 if t.dtype == torch.float64 else torch.float32
            merged = t.to(work) + (scaling * b.to(work)) @ a.to(work)
            out[f"{path}.weight"] = merged.to(t.dtype)
        else:
            out[f"{path}.{field}"] = t
    return out


def lora_record(module: torch.nn.Module) -> dict | None:
    """{"r", "alpha"} of the module's LoRA layers, for a checkpoint's manifest; None without LoRA
    layers or when they differ (then merge-lora needs --scaling)."""
    from trident.peft.lora import LoRALinear
    pairs = {(m.r, float(m.alpha)) for m in module.modules() if isinstance(m, LoRALinear)}
    if len(pairs) != 1:
        return None
    (r, alpha), = pairs
    return {"r": r, "alpha": alpha}


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
    from trident.checkpointing.consolidate import (checkpoint_folder, get_fp32_state_dict_from_zero_checkpoint,
                                                   write_state_dict)
    from trident.checkpointing.state import read_manifest

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

