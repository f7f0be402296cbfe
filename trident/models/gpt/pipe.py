"""The reference GPT as a `PipelineModule`: the same layers and math as `trident.models.gpt.GPT`.

    0      TiedLayerSpec("embed", TokenEmbedding)        idx -> wte(idx)
    1      PositionEmbedding                             x + wpe(positions), dropout
    2..    Block x n_layer                               (trident.models.gpt.Block)
    n + 2  FinalNorm                                     ln_f
    n + 3  TiedLayerSpec("embed", ..., forward_fn=logits) x @ wte^T   (LMHead when untied)

With `mesh` (tp > 1) the layers are tensor-parallel as `GPT(cfg, mesh)` is: the token table is
split by vocabulary rows (padded to a multiple of tp), attention and MLP by heads / hidden
features, the tied output projection gives this rank's vocabulary slice of the logits and the
loss is `vocab_parallel_cross_entropy`. With `sequence_parallel` the activations between layers
(and between stages) are this rank's slice of the sequence. Parameter names are the same as
without tp, so checkpoints and `gpt_names` do not change.

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

from trident.models.gpt.model import GPT, Block, GPTConfig, counted_tokens
from trident.models.gpt.plan import BLOCK_PLAN
from trident.parallel.rng import RNGTracker
from trident.pipeline.adopted import local_part
from trident.pipeline.aux_loss import add_aux_loss
from trident.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec
from trident.tensor_parallel import (SequenceParallelDropout, VocabParallelEmbedding, mark_sequence_parallel,
                                     shard_specs, vocab_parallel_cross_entropy)
from trident.tensor_parallel.layers import ColumnParallelLinear
from trident.tensor_parallel.mappings import (SEQUENCE_DIM, copy_to_tp_region,
                                              gather_from_sequence_parallel_region)
from trident.tensor_parallel.plan import apply_plan


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
        self.cp = None
        _init_like_gpt(self, cfg)

    def parallelize_context(self, cp) -> None:
        """Under context parallelism the first stage takes whole sequences in and embeds its shard."""
        self.cp = cp

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.shape[1] > self.seq_len:
            raise ValueError(f"input has {idx.shape[1]} tokens but the model's seq_len is {self.seq_len}; "
                             f"truncate the input or build a longer model")
        return super().forward(idx if self.cp is None else self.cp.shard(idx))


def tied_logits(embedding: TokenEmbedding, x: torch.Tensor) -> torch.Tensor:
    """Output projection through the token table: logits = x wte^T."""
    return F.linear(x, embedding.weight)


class PositionEmbedding(nn.Module):
    """Adds the learned position table `wpe`, then dropout."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.cp = None
        _init_like_gpt(self, cfg)

    def parallelize_context(self, cp) -> None:
        """Under context parallelism `x` is this cp rank's shard: add its global positions."""
        self.cp = cp

    def positions(self, local_len: int, device) -> torch.Tensor:
        """Positions of a local sequence of `local_len` tokens (global ones under cp)."""
        if self.cp is None:
            return torch.arange(local_len, device=device)
        return self.cp.positions(local_len * self.cp.size, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(x + self.wpe(self.positions(x.shape[1], x.device)))


class PipeBlock(Block):
    """GPT's transformer block `layer`, initialised as GPT initialises it. A mixture-of-experts
    block hands its auxiliary loss to `trident.pipeline.aux_loss`, which adds it to the training
    loss from whichever stage the block is on."""

    def __init__(self, cfg: GPTConfig, layer: int = 0) -> None:
        super().__init__(cfg, layer)
        self.dropout = cfg.dropout
        _init_like_gpt(self, cfg)

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        out = super().forward(x, doc_ids)
        return out if self.aux_loss is None else add_aux_loss(out, self.aux_loss)

    def parallelize_context(self, cp) -> None:
        """Attention over the whole sequence from this cp rank's shard (see GPT.parallelize_context)."""
        if self.dropout > 0:
            raise ValueError(f"gpt_pipe: dropout={self.dropout} under context parallelism is not supported (ring "
                             f"and Ulysses attention have no attention dropout); set model dropout to 0")
        self.attn.cp = cp


class TokenMeanLoss:
    """What GPT's pipeline losses share: a mean over the targets other than -100, taken over
    every cp rank's tokens under context parallelism."""

    cp = None

    def parallelize_context(self, cp) -> None:
        self.cp = cp

    def loss_tokens(self, targets: torch.Tensor) -> torch.Tensor:
        """The tokens the loss is a mean over (token-weighted losses, trident.engine.token_loss)."""
        return counted_tokens(targets)


class GPTLoss(TokenMeanLoss):
    """GPT's mean cross-entropy; under context parallelism, over every cp rank's tokens."""

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.cp is None:
            return GPT.loss(logits, targets)
        targets = self.cp.shard(targets)
        total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="sum")
        return self.cp.global_mean(total, (targets != -100).sum())


class FinalNorm(nn.LayerNorm):
    """`ln_f`."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg.d_model, bias=cfg.bias)


class LMHead(nn.Linear):
    """The output projection when embeddings are not tied."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg.d_model, cfg.vocab_size, bias=False)
        _init_like_gpt(self, cfg)


# -- tensor-parallel layers (mesh.tp_size > 1) -------------------------------------------------------

class TPTokenEmbedding(VocabParallelEmbedding):
    """`wte` split by vocabulary rows; under sequence parallelism it returns this rank's
    sequence shard (the partial lookups are reduce-scattered)."""

    def __init__(self, cfg: GPTConfig, mesh, sequence_parallel: bool) -> None:
        super().__init__(cfg.vocab_size, cfg.d_model, mesh, sequence_parallel=sequence_parallel,
                         _full=TokenEmbedding(cfg))
        self.seq_len = cfg.seq_len
        self.cp = None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.shape[1] > self.seq_len:
            raise ValueError(f"input has {idx.shape[1]} tokens but the model's seq_len is {self.seq_len}; "
                             f"truncate the input or build a longer model")
        if self.cp is not None:
            idx = self.cp.shard(idx)
        if self.sequence_parallel and idx.shape[1] % self.tp_size:
            raise ValueError(f"input has {idx.shape[1]} tokens (per cp rank), not divisible by tp={self.tp_size}; "
                             f"sequence parallelism splits the sequence evenly, so pad or truncate the input")
        return super().forward(idx)

    def parallelize_context(self, cp) -> None:
        """Under context parallelism the first stage takes whole sequences in and embeds its shard."""
        self.cp = cp


def tp_tied_logits(embedding: TPTokenEmbedding, x: torch.Tensor) -> torch.Tensor:
    """This rank's vocabulary slice of the logits through the split token table (the whole
    sequence: a sequence-parallel input is gathered first)."""
    if embedding.sequence_parallel:
        x = gather_from_sequence_parallel_region(x, embedding.tp_group, embedding.logger, SEQUENCE_DIM)
    else:
        x = copy_to_tp_region(x, embedding.tp_group, embedding.logger)
    return F.linear(x, embedding.weight)


class TPPositionEmbedding(PositionEmbedding):
    """Adds `wpe` (replicated); under sequence parallelism only this rank's positions, with
    the sequence-parallel dropout, and wpe's gradient summed over tp."""

    def __init__(self, cfg: GPTConfig, mesh, sequence_parallel: bool) -> None:
        super().__init__(cfg)
        self.shard = (mesh.tp_rank, mesh.tp_size) if sequence_parallel else None
        if sequence_parallel:
            self.drop = SequenceParallelDropout(cfg.dropout, mesh)
            mark_sequence_parallel(self.wpe.weight, mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shard is None:
            return super().forward(x)
        rank, size = self.shard
        positions = self.positions(x.shape[1] * size, x.device).chunk(size)[rank]
        return self.drop(x + self.wpe(positions))


class TPPipeBlock(PipeBlock):
    """GPT block `index` split over tp like GPT's: heads and MLP features; per-head dropout
    streams from an RNGTracker (the same streams GPT's block `index` uses)."""

    def __init__(self, cfg: GPTConfig, mesh, sequence_parallel: bool, index: int, rng_seed: int) -> None:
        super().__init__(cfg)
        apply_plan(self, BLOCK_PLAN, mesh, sequence_parallel=sequence_parallel)
        device = self.ln_1.weight.device
        tracker = RNGTracker.for_mesh(rng_seed, mesh, "cpu" if device.type == "meta" else device)
        local = cfg.n_head // mesh.tp_size
        self.attn.head_rng = tracker.unit_generators(f"blocks.{index}.attn",
                                                     range(mesh.tp_rank * local, (mesh.tp_rank + 1) * local))
        if sequence_parallel:
            self.attn.resid_drop = SequenceParallelDropout(cfg.dropout, mesh)
            self.mlp.drop = SequenceParallelDropout(cfg.dropout, mesh)
            for param in (*self.ln_1.parameters(), *self.ln_2.parameters()):
                mark_sequence_parallel(param, mesh)


class TPFinalNorm(FinalNorm):
    """`ln_f`; its gradients summed over tp under sequence parallelism."""

    def __init__(self, cfg: GPTConfig, mesh, sequence_parallel: bool) -> None:
        super().__init__(cfg)
        if sequence_parallel:
            for param in self.parameters():
                mark_sequence_parallel(param, mesh)


class TPLMHead(ColumnParallelLinear):
    """An untied output projection split by vocabulary (padded), the whole sequence in."""

    def __init__(self, cfg: GPTConfig, mesh, sequence_parallel: bool) -> None:
        super().__init__(cfg.d_model, cfg.vocab_size, mesh, bias=False, sequence_parallel=sequence_parallel,
                         pad_vocab=True, _full=LMHead(cfg))


class VocabParallelLoss(TokenMeanLoss):
    """GPT's mean cross-entropy over logits split by vocabulary across the tp group."""

    def __init__(self, mesh, vocab_size: int) -> None:
        self.group, self.vocab_size = mesh.tp_group, vocab_size

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.cp is None:
            return vocab_parallel_cross_entropy(logits.float(), targets, self.group, vocab_size=self.vocab_size)
        targets = self.cp.shard(targets)
        total = vocab_parallel_cross_entropy(logits.float(), targets, self.group, vocab_size=self.vocab_size,
                                             reduction="sum")
        return self.cp.global_mean(total, (targets != -100).sum())


def _tp_layers(cfg: GPTConfig, mesh, sequence_parallel: bool, rng_seed: int) -> list[LayerSpec]:
    tp = (mesh, sequence_parallel)
    if cfg.tie_embeddings:
        first = TiedLayerSpec("embed", TPTokenEmbedding, cfg, *tp)
        last = TiedLayerSpec("embed", TPTokenEmbedding, cfg, *tp, forward_fn=tp_tied_logits)
    else:
        first, last = LayerSpec(TPTokenEmbedding, cfg, *tp), LayerSpec(TPLMHead, cfg, *tp)
    blocks = [LayerSpec(TPPipeBlock, cfg, *tp, i, rng_seed) for i in range(cfg.n_layer)]
    return [first, LayerSpec(TPPositionEmbedding, cfg, *tp), *blocks, LayerSpec(TPFinalNorm, cfg, *tp), last]


def gpt_layers(cfg: GPTConfig) -> list[LayerSpec]:
    """The layer list of the reference GPT (see the module docstring)."""
    if cfg.tie_embeddings:
        first = TiedLayerSpec("embed", TokenEmbedding, cfg)
        last = TiedLayerSpec("embed", TokenEmbedding, cfg, forward_fn=tied_logits)
    else:
        first, last = LayerSpec(TokenEmbedding, cfg), LayerSpec(LMHead, cfg)
    blocks = [LayerSpec(PipeBlock, cfg, i) for i in range(cfg.n_layer)]
    return [first, LayerSpec(PositionEmbedding, cfg), *blocks, LayerSpec(FinalNorm, cfg), last]


def gpt_pipe(cfg: GPTConfig, num_stages: int, partition_method: str = "type:Block", virtual_stages: int = 1,
             activation_checkpoint_interval: int = 0, stage_id: int | None = None, *, mesh=None,
             sequence_parallel: bool = False, rng_seed: int | None = None) -> PipelineModule:
    """The reference GPT as a PipelineModule; the loss is GPT's mean cross-entropy.

    With `mesh` (tp > 1) the layers are tensor-parallel over its tp group (see the module
    docstring); `rng_seed` seeds the per-head dropout streams (default torch.initial_seed()).
    """
    if mesh is not None and mesh.tp_size > 1:
        if cfg.n_head % mesh.tp_size:
            raise ValueError(f"gpt_pipe: n_head={cfg.n_head} is not divisible by tp={mesh.tp_size}; attention is "
                             f"split by heads, so choose a tp size that divides {cfg.n_head}")
        if sequence_parallel and cfg.seq_len % mesh.tp_size:
            raise ValueError(f"gpt_pipe: seq_len={cfg.seq_len} is not divisible by tp={mesh.tp_size}; sequence "
                             f"parallelism splits the sequence, so choose a multiple of {mesh.tp_size}")
        seed = torch.initial_seed() if rng_seed is None else rng_seed
        layers, loss = _tp_layers(cfg, mesh, sequence_parallel, seed), VocabParallelLoss(mesh, cfg.vocab_size)
    elif sequence_parallel:
        raise ValueError("gpt_pipe: sequence_parallel=True needs mesh=<ParallelMesh> with tp > 1")
    else:
        layers, loss = gpt_layers(cfg), GPTLoss()
    return PipelineModule(layers, num_stages=num_stages, loss_fn=loss,
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
    own = pipe.state_dict(keep_vars=True)
    unknown = sorted(k for k in own if k not in to_gpt)
    if unknown:
        raise KeyError(f"pipeline tensors {unknown[:5]} have no counterpart in GPT; is this module built by "
                       f"gpt_pipe() with the same GPTConfig?")
    pipe.load_state_dict({k: local_part(pipe, t, gpt_state[to_gpt[k]]) for k, t in own.items()})


def gpt_shard_specs(pipe: PipelineModule, cfg: GPTConfig) -> dict:
    """This stage's tensor-parallel ShardSpecs under GPT's state_dict keys (for merge_state_dicts)."""
    split = shard_specs(pipe)
    return {gpt_key: split[pipe_key] for gpt_key, pipe_key in gpt_names(cfg).items() if pipe_key in split}


def gpt_state_dict(pipe: PipelineModule, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """This stage's weights under GPT's state_dict keys (the inverse of `load_gpt_state_dict`)."""
    own = pipe.state_dict()
    return {gpt_key: own[pipe_key] for gpt_key, pipe_key in gpt_names(cfg).items() if pipe_key in own}
