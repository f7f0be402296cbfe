"""The reference GPT as a `PipelineModule`: the same layers and math as `trident.models.gpt.GPT`.

    0      TiedLayerSpec("embed", TokenEmbedding)        idx -> wte(idx)
    1      PositionEmbedding                             x + wpe(positions), dropout
    2..    Block x n_layer                               (trident.models.gpt.Block)
    n + 2  FinalNorm                                     ln_f
    n + 3  TiedLayerSpec("embed", ..., forward_fn=logits) x @ wte^T   (LMHead when untied)

Every layer initialises itself with GPT's rules (normal(0, init_std), the two residual
projections scaled by 1 / sqrt(2 n_layer), norms 1, biases 0), but draws from the global RNG
of the stage that builds it, so its weights differ from a serial GPT's with the same seed;
`load_gpt_state_dict` copies a serial GPT's weights in (each stage takes its own), and
`gpt_state_dict` maps a stage's weights back to GPT's names, for parity checks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trident.models.gpt import GPT, Block, GPTConfig
from trident.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec


@torch.no_grad()
def _init_like_gpt(module: nn.Module, cfg: GPTConfig) -> None:
    residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layer)
    for name, sub in module.named_modules():
        if isinstance(sub, nn.LayerNorm):
            nn.init.ones_(sub.weight)
            if sub.bias is not None:
                nn.init.zeros_(sub.bias)
        elif isinstance(sub, (nn.Linear, nn.Embedding)):
            residual = name.endswith(("attn.proj", "mlp.proj"))
            nn.init.normal_(sub.weight, mean=0.0, std=residual_std if residual else cfg.init_std)
            if getattr(sub, "bias", None) is not None:
                nn.init.zeros_(sub.bias)


class TokenEmbedding(nn.Embedding):
    """The token table `wte`; also the output projection when embeddings are tied."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg.vocab_size, cfg.d_model)
        self.seq_len = cfg.seq_len
        _init_like_gpt(self, cfg)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.shape[1] > self.seq_len:
            raise ValueError(f"input has {idx.shape[1]} tokens but the model's seq_len is {self.seq_len}; "
                             f"truncate the input or build a longer model")
        return super().forward(idx)


def tied_logits(embedding: TokenEmbedding, x: torch.Tensor) -> torch.Tensor:
    """Output projection through the token table: logits = x wte^T."""
    return F.linear(x, embedding.weight)


class PositionEmbedding(nn.Module):
    """Adds the learned position table `wpe`, then dropout."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        _init_like_gpt(self, cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(x + self.wpe(torch.arange(x.shape[1], device=x.device)))


class PipeBlock(Block):
    """GPT's transformer block, initialised as GPT initialises it."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        _init_like_gpt(self, cfg)


class FinalNorm(nn.LayerNorm):
    """`ln_f`."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg.d_model, bias=cfg.bias)


class LMHead(nn.Linear):
    """The output projection when embeddings are not tied."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg.d_model, cfg.vocab_size, bias=False)
        _init_like_gpt(self, cfg)


def gpt_layers(cfg: GPTConfig) -> list[LayerSpec]:
    """The layer list of the reference GPT (see the module docstring)."""
    if cfg.tie_embeddings:
        first = TiedLayerSpec("embed", TokenEmbedding, cfg)
        last = TiedLayerSpec("embed", TokenEmbedding, cfg, forward_fn=tied_logits)
    else:
        first, last = LayerSpec(TokenEmbedding, cfg), LayerSpec(LMHead, cfg)
    blocks = [LayerSpec(PipeBlock, cfg) for _ in range(cfg.n_layer)]
    return [first, LayerSpec(PositionEmbedding, cfg), *blocks, LayerSpec(FinalNorm, cfg), last]


def gpt_pipe(cfg: GPTConfig, num_stages: int, partition_method: str = "type:Block", virtual_stages: int = 1,
             activation_checkpoint_interval: int = 0, stage_id: int | None = None) -> PipelineModule:
    """The reference GPT as a PipelineModule; the loss is GPT's mean cross-entropy."""
    return PipelineModule(gpt_layers(cfg), num_stages=num_stages, loss_fn=GPT.loss,
                          partition_method=partition_method, virtual_stages=virtual_stages,
                          activation_checkpoint_interval=activation_checkpoint_interval, stage_id=stage_id)


def gpt_names(cfg: GPTConfig) -> dict[str, str]:
    """GPT state_dict key -> the key of the same tensor in a pipeline module's state_dict.

    With tied embeddings `embed.wte.weight` and `lm_head.weight` (one tensor in GPT) both map
    to the shared module's weight.
    """
    n = cfg.n_layer
    wte = "tied_modules.embed.weight" if cfg.tie_embeddings else "0.weight"
    names = {"embed.wte.weight": wte, "embed.wpe.weight": "1.wpe.weight"}
    with torch.device("meta"):
        block_params = [name for name, _ in Block(cfg).state_dict().items()]
    for i in range(n):
        names.update({f"blocks.{i}.{name}": f"{i + 2}.{name}" for name in block_params})
    names["ln_f.weight"] = f"{n + 2}.weight"
    if cfg.bias:
        names["ln_f.bias"] = f"{n + 2}.bias"
    names["lm_head.weight"] = wte if cfg.tie_embeddings else f"{n + 3}.weight"
    return names


def load_gpt_state_dict(pipe: PipelineModule, gpt_state: dict[str, torch.Tensor], cfg: GPTConfig) -> None:
    """Copy a serial GPT's weights into this stage's layers (each stage takes the ones it holds)."""
    to_gpt = {}
    for gpt_key, pipe_key in gpt_names(cfg).items():
        to_gpt.setdefault(pipe_key, gpt_key)
    own = pipe.state_dict()
    unknown = sorted(k for k in own if k not in to_gpt)
    if unknown:
        raise KeyError(f"pipeline tensors {unknown[:5]} have no counterpart in GPT; is this module built by "
                       f"gpt_pipe() with the same GPTConfig?")
    pipe.load_state_dict({k: gpt_state[to_gpt[k]] for k in own})


def gpt_state_dict(pipe: PipelineModule, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """This stage's weights under GPT's state_dict keys (the inverse of `load_gpt_state_dict`)."""
    own = pipe.state_dict()
    return {gpt_key: own[pipe_key] for gpt_key, pipe_key in gpt_names(cfg).items() if pipe_key in own}
