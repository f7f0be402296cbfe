"""`MoESpec`: the mixture-of-experts settings of a model (the reference GPT's `GPTConfig.moe`,
`model.moe` in a `trident train` config)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass
class MoESpec:
    """Which blocks are MoE and how they route; the fields are `trident.moe.MoE`'s arguments."""

    num_experts: int = 8
    k: int = 2
    every_n_layers: int = 1
    capacity_factor: float = 1.0
    eval_capacity_factor: float = 1.0
    min_capacity: int = 4
    drop_tokens: bool = True
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    noisy_gate_policy: str | None = None

    def __post_init__(self) -> None:
        from trident.moe.layer import check_moe_args
        if not isinstance(self.every_n_layers, int) or self.every_n_layers < 1:
            raise ValueError(f"MoESpec.every_n_layers must be a positive integer, got {self.every_n_layers!r}")
        check_moe_args(self.num_experts, 1, self.k, self.capacity_factor, self.eval_capacity_factor,
                       self.min_capacity, self.noisy_gate_policy)

    def is_moe_layer(self, layer: int) -> bool:
        """Blocks every_n_layers - 1, 2 x every_n_layers - 1, ... (every block when it is 1)."""
        return (layer + 1) % self.every_n_layers == 0

    def build(self, hidden_size: int, expert: nn.Module, layer: int) -> nn.Module:
        """The MoE layer of block `layer`, holding every expert (ep is applied later)."""
        from trident.moe.layer import MoE
        return MoE(hidden_size, expert, self.num_experts, 1, self.k, self.capacity_factor, self.eval_capacity_factor,
                   self.min_capacity, drop_tokens=self.drop_tokens, noisy_gate_policy=self.noisy_gate_policy,
                   aux_loss_coef=self.aux_loss_coef, z_loss_coef=self.z_loss_coef, name=f"blocks.{layer}.mlp")
