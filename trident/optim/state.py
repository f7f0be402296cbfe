"""Helpers for optimizer state that is moved between layouts (checkpoint resharding)."""

from __future__ import annotations

import torch


def own_state(state: dict) -> dict:
    """A copy whose tensors belong to one parameter alone: torch steps a shared `step` tensor in
    place once per parameter, so parameters (or ZeRO chunks) must never share one."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
