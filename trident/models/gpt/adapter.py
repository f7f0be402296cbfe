"""The reference GPT's `ModelAdapter`: what the parallel packages may ask about a `GPT`.

GPT parallelizes itself (`GPT(cfg, mesh)` / `parallelize_tensor`: its vocabulary-parallel loss,
per-head dropout streams and sequence-parallel norms are part of the model), so the adapter
refuses plans applied from outside and sequence parallelism from outside; context parallelism
is GPT's own `parallelize_context`. Its pipeline is built by `gpt_pipe`, not split from a
built model.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from trident.models.gpt.model import GPT, counted_tokens
from trident.models.gpt.plan import PLAN


class GPTAdapter:
    """The adapter of the outermost `GPT` inside `root` (`root` itself included)."""

    family = "gpt"

    def __init__(self, root: nn.Module, gpt: GPT, prefix: str) -> None:
        self.root, self.gpt, self.prefix = root, gpt, prefix

    @classmethod
    def find(cls, root: nn.Module) -> "GPTAdapter | None":
        for name, module in root.named_modules():
            if isinstance(module, GPT):
                return cls(root, module, f"{name}." if name else "")
        return None

    def decoder_layers(self) -> list[tuple[str, nn.Module]]:
        return [(f"{self.prefix}blocks.{i}", block) for i, block in enumerate(self.gpt.blocks)]

    def embedding_and_head(self) -> tuple[str, str]:
        return f"{self.prefix}embed.wte", f"{self.prefix}lm_head"

    def tensor_parallel_plan(self, which: str, tp: int) -> dict[str, Any]:
        raise ValueError(f"tensor_parallel.plan={which!r}: GPT splits itself over tp (GPT(cfg, mesh) or "
                         f"parallelize_tensor: its vocabulary-parallel loss and per-head dropout streams come with "
                         f"it; its plan is {sorted(PLAN)}); set tensor_parallel.plan to null")

    def check_tensor_parallel(self, tp: int) -> None:
        """GPT checks its heads itself (`parallelize_tensor`) and reads them from `qkv`'s width."""

    def localize_tensor_parallel(self, tp: int) -> None:
        """Nothing to count again: attention reads its local heads from `qkv`'s output."""

    def sequence_parallel_layout(self) -> Any:
        raise ValueError("tensor_parallel.sequence_parallel: GPT runs on sequence shards by itself; build it with "
                         "GPT(cfg, mesh, sequence_parallel=True) and leave tensor_parallel.plan null")

    def parallelize_context(self, cp: Any) -> bool:
        self.gpt.parallelize_context(cp)
        return True

    def split_pipeline(self, num_stages: int, **options: Any) -> nn.Module | None:
        return None  # trident.models.gpt_pipe builds GPT's stages layer by layer

    def state_dict_names(self) -> dict[str, str]:
        return {k: k[len(self.prefix):] for k in self.root.state_dict() if k.startswith(self.prefix)}

    def export_root(self) -> tuple[str, nn.Module] | None:
        return None  # GPT's checkpoints are its own state dicts; there is no other format to write

    def export_record(self) -> dict | None:
        return None

    def loss_tokens(self, args: tuple, kwargs: dict) -> Any:
        if self.root is not self.gpt:
            return None  # a wrapper: its arguments are its own
        targets = args[1] if len(args) > 1 else kwargs.get("targets")
        return None if targets is None else counted_tokens(targets)
