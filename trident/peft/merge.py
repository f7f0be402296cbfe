"""Fold LoRA adapters into plain weights, on a state dict: what `trident checkpoint merge-lora` writes.

`apply_lora` renames each adapted layer's tensors: `<path>.weight` becomes `<path>.base.weight`
next to `<path>.lora_A` (r x in) and `<path>.lora_B` (out x r). Merging computes

    <path>.weight = <path>.base.weight + scaling * <path>.lora_B @ <path>.lora_A

moves every other `<path>.base.<x>` (the bias) back to `<path>.<x>` and drops the adapters, so
the result loads into the model as it was before `apply_lora`. The state dict must be whole
(tp slices merged, as `get_fp32_state_dict_from_zero_checkpoint` gives it); `merge_lora` does
the same on a live model. scaling = alpha / r, which a checkpoint's manifest records under
`lora` (`lora_record`, written at save time); `trident.checkpointing.lora` merges a checkpoint.
"""

from __future__ import annotations

import torch

A, B, BASE = ".lora_A", ".lora_B", ".base."


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
