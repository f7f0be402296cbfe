"""GPT-2: no published plans, `Conv1D` layers, learned positions, a fused `c_attn`.

GPT-2 publishes neither a pipeline plan nor a tensor-parallel plan, so this family gives both:
its layout (`wte`, then `wpe` and `drop` between the embedding and the blocks `h`, then `ln_f`),
the layer that adds the positions on a pipeline stage (`GPT2Positions`), and the preset "gpt2"
(GPT-2 / nanoGPT module names; `Conv1D` is split in its own transposed layout, `c_attn`'s
[q | k | v] with stride 3 so each rank keeps whole heads), which "auto" takes. A split attention
reads its heads from `num_heads`, `embed_dim` and `split_size`, which are divided by tp.
"""

from __future__ import annotations

import torch
from torch import nn

from trident.models.transformers import DecoderLayout, TransformersAdapter
from trident.models.transformers.tensor_parallel import divide_attribute
from trident.pipeline.adopted import ModelPart
from trident.pipeline.module import LayerSpec
from trident.tensor_parallel.styles import Column, Row, Vocab

GPT2_PLAN = {
    "wte": Vocab(),
    "attn.c_attn": Column(stride=3),
    "attn.c_proj": Row(),
    "mlp.c_fc": Column(),
    "mlp.c_proj": Row(),
    "lm_head": Column(gather_output=True, pad_vocab=True),
}
"""The preset "gpt2": GPT-2 module names (nanoGPT / HF) with nn.Linear or Conv1D layers."""

ATTENTIONS = ("GPT2Attention", "GPT2SdpaAttention", "GPT2FlashAttention2")
HEAD_ATTRIBUTES = ("num_heads", "embed_dim", "split_size")


class GPT2Positions(ModelPart):
    """GPT-2's step between the token embedding and the first block: + wpe(positions), dropout."""

    def __init__(self, wpe: tuple[str, nn.Module], drop: tuple[str, nn.Module]) -> None:
        super().__init__([("wpe", *wpe), ("drop", *drop)])

    def forward(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device).unsqueeze(0)
        return self.drop(inputs_embeds + self.wpe(positions).to(inputs_embeds.device))


class GPT2Adapter(TransformersAdapter):
    family = "gpt2"
    model_types = ("gpt2",)
    layout = DecoderLayout(before=("wte", "wpe", "drop"), layers="h", after=("ln_f",))
    presets = {"gpt2": "gpt2"}

    def between_layer(self, parts: list[tuple[str, nn.Module]]) -> LayerSpec:
        return LayerSpec(GPT2Positions, *parts)

    def localize_heads(self, tp: int, dry_run: bool = False) -> list[str]:
        changed = []
        for name, module in self.root.named_modules():
            if type(module).__name__ in ATTENTIONS:
                for attr in HEAD_ATTRIBUTES:
                    divide_attribute(module, name, attr, tp, dry_run)
                changed.append(name)
        return changed
