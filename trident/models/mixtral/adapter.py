"""Mixtral: LLaMA's attention with a mixture-of-experts MLP (`MixtralSparseMoeBlock`).

The experts are one module holding every expert's weights as 3-d parameters (`gate_up_proj`,
`down_proj`), which transformers' own plan splits with styles trident's layers do not have
(`packed_colwise`, `moe_tp_experts`). This family keeps the router and the experts whole on
every tp rank (each rank routes every token and runs every expert; the gradients agree) and
splits attention, the embedding and the head by the published plan. Sequence parallelism is
refused by the shared check (the experts are replicated weights outside attention that are not
a norm).

With `config.output_router_logits` the model adds the router's load-balancing loss in its own
forward: a pipeline stage's loss (the model's `loss_function`) would leave it out, and under
context parallelism it would be computed over this rank's tokens only, so both are refused then.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from trident.models.transformers import TransformersAdapter

MOE_PARTS = ("experts", "gate")
"""Names, inside the sparse MoE block, of the modules kept whole on every tp rank."""


class MixtralAdapter(TransformersAdapter):
    family = "mixtral"
    model_types = ("mixtral",)

    def published_plan(self) -> dict[str, str]:
        plan = super().published_plan()
        return {p: s for p, s in plan.items() if not _in_moe_block(p)}

    def parallelize_context(self, cp: Any) -> bool:
        self._refuse_router_loss("context parallelism (the load-balancing loss would see this rank's tokens only)")
        return super().parallelize_context(cp)

    def split_pipeline(self, num_stages: int, **options: Any) -> nn.Module | None:
        self._refuse_router_loss("pipeline parallelism (a stage's loss is the model's loss_function, without it)")
        return super().split_pipeline(num_stages, **options)

    def _refuse_router_loss(self, what: str) -> None:
        config = getattr(self.model, "config", None)
        if getattr(config, "output_router_logits", False):
            raise ValueError(f"{type(self.model).__name__}: config.output_router_logits=True adds the router's "
                             f"load-balancing loss inside the model's forward, which {what} does not keep; set "
                             f"output_router_logits to False for this layout")


def _in_moe_block(pattern: str) -> bool:
    """Whether plan pattern `pattern` names the router or the experts (or a tensor of them)."""
    parts = pattern.split(".")
    return any(a == "mlp" and b in MOE_PARTS for a, b in zip(parts, parts[1:]))
