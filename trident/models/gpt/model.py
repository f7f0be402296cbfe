"""The reference GPT: a GPT-2-style decoder that every parallel layout is checked against.

    idx -> Embedding(tok + pos) -> n_layer x Block -> ln_f -> lm_head -> logits
    Block: x + attn(ln_1(x)), then x + mlp(ln_2(x))         (pre-LayerNorm)

Built as `GPT(cfg)` the model is plain PyTorch. Every layer that tensor parallelism replaces
is a plainly named submodule (`embed.wte`, `attn.qkv`, `attn.proj`, `mlp.fc`, `mlp.proj`,
`lm_head`), and the attention reads its number of heads from the width of `qkv`'s output, so a
column-parallel `qkv` holding some of the heads works unchanged.

`GPT(cfg, mesh)` (or `parallelize_tensor(mesh)` later) takes tp from the mesh: vocabulary-
parallel embedding and loss, attention split by heads, the MLP split column-then-row; two
all-reduces forward and two backward per block. With `sequence_parallel` the LayerNorms,
dropouts and residual stream work on sequence shards. The full weights are drawn first and
then sliced, and every dropout mask equals the one a single process with the same mesh-built
model draws (see trident.tensor_parallel.dropout), so any tp size trains to the losses of tp=1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trident.comm.logger import CommsLogger
from trident.context_parallel.attention import attention as context_parallel_attention
from trident.models.gpt.plan import MLP_PATTERNS, PLAN
from trident.moe.spec import MoESpec
from trident.parallel.rng import RNGTracker
from trident.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from trident.tensor_parallel.dropout import SequenceParallelDropout, unit_dropout_mask
from trident.tensor_parallel.layers import TPHandle, mark_sequence_parallel
from trident.tensor_parallel.mappings import gather_from_tp_region
from trident.tensor_parallel.plan import apply_plan, tp_layers


@dataclass
class GPTConfig:
    """Shape of the model. `d_ff=None` means the GPT-2 ratio, 4 * d_model."""

    vocab_size: int
    seq_len: int
    n_layer: int
    n_head: int
    d_model: int
    d_ff: int | None = None
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True
    init_std: float = 0.02
    moe: MoESpec | dict | None = None  # mixture-of-experts MLPs (trident.moe); None = dense

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):
            self.moe = MoESpec(**self.moe)
        for key in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            if getattr(self, key) < 1:
                raise ValueError(f"GPTConfig.{key} must be >= 1, got {getattr(self, key)}")
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig.d_model={self.d_model} is not divisible by n_head={self.n_head}; "
                             f"choose d_model as a multiple of n_head")
        if self.d_ff is not None and self.d_ff < 1:
            raise ValueError(f"GPTConfig.d_ff must be >= 1 or None (4 * d_model), got {self.d_ff}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")

    @property
    def ff_dim(self) -> int:
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


# Shapes without vocab_size: the tokenizer decides it. "demo" is sized so that 150 steps of
# 2-rank data parallelism at micro batch 8 take about a minute and a half on a 2-core CPU.
GPT_PRESETS: dict[str, dict] = {
    "tiny": dict(n_layer=2, n_head=2, d_model=64, seq_len=64),
    "demo": dict(n_layer=4, n_head=4, d_model=256, seq_len=128),
    "small": dict(n_layer=6, n_head=6, d_model=384, seq_len=256),
    # Published models of this shape (also what `trident plan --model NAME` prices). GPT-2
    # (Radford et al. 2019; the Hugging Face gpt2* configs): context 1024.
    "gpt2-124m": dict(n_layer=12, n_head=12, d_model=768, seq_len=1024),
    "gpt2-355m": dict(n_layer=24, n_head=16, d_model=1024, seq_len=1024),
    "gpt2-774m": dict(n_layer=36, n_head=20, d_model=1280, seq_len=1024),
    "gpt2-1.5b": dict(n_layer=48, n_head=25, d_model=1600, seq_len=1024),
    # GPT-3 (Brown et al. 2020, Table 2.1): context 2048. Two rows of that table are not
    # self-consistent: 1.3B lists 24 heads of 128 for d_model 2048 (16 x 128 is used here), 13B
    # lists d_model 5140 for 40 heads of 128 (5120 is used).
    "gpt3-1.3b": dict(n_layer=24, n_head=16, d_model=2048, seq_len=2048),
    "gpt3-2.7b": dict(n_layer=32, n_head=32, d_model=2560, seq_len=2048),
    "gpt3-6.7b": dict(n_layer=32, n_head=32, d_model=4096, seq_len=2048),
    "gpt3-13b": dict(n_layer=40, n_head=40, d_model=5120, seq_len=2048),
    "gpt3-175b": dict(n_layer=96, n_head=96, d_model=12288, seq_len=2048),
    # Megatron-Turing NLG 530B (Smith et al. 2022, section 2.4).
    "mt-nlg-530b": dict(n_layer=105, n_head=128, d_model=20480, seq_len=2048),
    # OPT-175B (Zhang et al. 2022, arXiv:2205.01068, Table 1): GPT-3 175B's shape.
    "opt-175b": dict(n_layer=96, n_head=96, d_model=12288, seq_len=2048),
}
"""The reference GPT's shapes by name, without the vocabulary (a run's tokenizer decides it)."""

PUBLISHED_VOCAB: dict[str, int] = {
    **dict.fromkeys(["gpt2-124m", "gpt2-355m", "gpt2-774m", "gpt2-1.5b", "gpt3-1.3b", "gpt3-2.7b", "gpt3-6.7b",
                     "gpt3-13b", "gpt3-175b"], 50257),
    "mt-nlg-530b": 51200,  # Megatron's padded GPT-2 vocabulary
    "opt-175b": 50272,
}
"""The vocabulary each published preset was trained with (for pricing it as published)."""


def counted_tokens(targets: torch.Tensor) -> torch.Tensor:
    """How many targets GPT's loss is a mean over: those other than -100."""
    return (targets != -100).sum()


class Embedding(nn.Module):
    """Token plus learned position embeddings, then dropout.

    Under sequence parallelism `seq_shard` is (tp_rank, tp_size): `wte` returns this rank's
    sequence shard and only its positions are added.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.seq_shard: tuple[int, int] | None = None

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`position_ids` [B, T] (packed documents restart at 0); None = 0..T-1 for every row."""
        positions = torch.arange(idx.shape[1], device=idx.device) if position_ids is None else position_ids
        if self.seq_shard is not None:
            rank, size = self.seq_shard
            positions = positions.chunk(size, dim=-1)[rank]
        return self.drop(self.wte(idx) + self.wpe(positions))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused `qkv` projection.

    `qkv`'s output features are ordered (head, q|k|v, head_dim): each head's query, key and
    value sit together, so a contiguous slice of the output holds whole heads. That is what a
    column-parallel split of `qkv` (and a matching row-parallel `proj`) needs.

    `head_rng` (set by GPT.parallelize_tensor) holds one random stream per head held here:
    attention dropout then draws head h's mask from head h's stream, whatever the tp size.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.attn_dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.head_rng: list[torch.Generator] | None = None
        self.cp = None  # a ContextParallel when the sequence is split over cp ranks

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`doc_ids` [B, T]: the document of each position of a packed sequence; a query then
        attends only to earlier positions of its own document. None = one document per row."""
        q, k, v = self.split_heads(self.qkv(x))
        p = self.attn_dropout if self.training else 0.0
        if self.cp is not None:
            y = context_parallel_attention(q, k, v, causal=True, doc_ids=doc_ids, cp=self.cp)
        elif self.head_rng is not None and p > 0:
            y = self.attend_with_head_dropout(q, k, v, p, doc_ids)
        elif doc_ids is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(doc_ids), dropout_p=p)
        return self.resid_drop(self.proj(self.merge_heads(y)))

    def attend_with_head_dropout(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float,
                                 doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Causal softmax attention whose dropout mask for head h comes from `head_rng[h]`."""
        t = q.shape[-2]
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        if doc_ids is None:
            hidden = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
        else:
            hidden = ~document_causal_mask(doc_ids)
        att = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
        att = att * unit_dropout_mask(att.shape, 1, self.head_rng, p, dtype=att.dtype, device=att.device)
        return att @ v

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, T, heads * 3 * hd] -> q, k, v, each [B, heads, T, hd]; heads = width / (3 * hd)."""
        b, t, width = qkv.shape
        heads = width // (3 * self.head_dim)
        q, k, v = qkv.view(b, t, heads, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        return q, k, v

    @staticmethod
    def merge_heads(y: torch.Tensor) -> torch.Tensor:
        """[B, heads, T, hd] -> [B, T, heads * hd]."""
        b, h, t, hd = y.shape
        return y.transpose(1, 2).reshape(b, t, h * hd)


def document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] document ids -> [B, 1, T, T] bool mask, True where query i may attend key j:
    j <= i and both in the same document (block-diagonal causal attention of packed sequences)."""
    t = doc_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=doc_ids.device).tril()
    same = doc_ids.unsqueeze(-1) == doc_ids.unsqueeze(-2)
    return (same & causal).unsqueeze(1)


class MLP(nn.Module):
    """fc (d_model -> d_ff), GELU, proj (d_ff -> d_model), dropout."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.ff_dim, bias=cfg.bias)
        self.act = nn.GELU()
        self.proj = nn.Linear(cfg.ff_dim, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x)).

    With `cfg.moe`, block `layer` (0-based) has a mixture-of-experts `mlp` (a `trident.moe.MoE`
    of `MLP` experts) when `cfg.moe.is_moe_layer(layer)`; its last auxiliary loss is kept in
    `aux_loss` for the model's loss."""

    def __init__(self, cfg: GPTConfig, layer: int = 0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = cfg.moe.build(cfg.d_model, MLP(cfg), layer) if cfg.moe and cfg.moe.is_moe_layer(layer) else MLP(cfg)
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), doc_ids)
        y = self.mlp(self.ln_2(x))
        if isinstance(y, tuple):  # MoE: (output, aux_loss, expert_counts)
            y, self.aux_loss, _ = y
        return x + y


class GPT(nn.Module):
    """Decoder-only language model; `forward(idx)` gives logits, `forward(idx, targets)` the loss.

    With `mesh` (a ParallelMesh) the model is tensor-parallel over the mesh's tp group: see
    `parallelize_tensor` for the other arguments.
    """

    def __init__(self, cfg: GPTConfig, mesh=None, *, sequence_parallel: bool = False,
                 logger: CommsLogger | None = None, rng_seed: int | None = None):
        super().__init__()
        self.config = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.init_weights()
        self.tp: TPHandle | None = None
        self.sequence_parallel = False
        self.rng_tracker: RNGTracker | None = None
        self.cp = None  # ContextParallel, set by parallelize_context
        if mesh is not None:
            self.parallelize_tensor(mesh, sequence_parallel=sequence_parallel, logger=logger, rng_seed=rng_seed)
        elif sequence_parallel:
            raise ValueError("GPT: sequence_parallel=True needs mesh=<ParallelMesh>; it splits the sequence "
                             "over the mesh's tp ranks")

    def parallelize_tensor(self, mesh, *, sequence_parallel: bool = False, logger: CommsLogger | None = None,
                           rng_seed: int | None = None) -> None:
        """Split this model over `mesh`'s tp ranks in place (before creating the optimizer).

        Heads must divide by tp; the vocabulary is padded to a multiple of tp (Megatron-LM's
        convention) and the pad logits are excluded from the loss. `sequence_parallel` needs
        seq_len divisible by tp. `logger` counts the collectives. `rng_seed` seeds the
        per-head dropout streams (default: torch.initial_seed(), the same on every rank that
        seeded torch alike); `rng_tracker.get_states()` / `set_states()` replay them.
        """
        cfg, tp = self.config, mesh.tp_size
        if tp_layers(self):
            raise ValueError("GPT.parallelize_tensor: the model is already tensor-parallel")
        if cfg.n_head % tp:
            raise ValueError(f"GPT: n_head={cfg.n_head} is not divisible by tensor_parallel.size={tp}; attention "
                             f"is split by heads, so choose a tp size that divides {cfg.n_head}")
        if sequence_parallel and cfg.seq_len % tp:
            raise ValueError(f"GPT: seq_len={cfg.seq_len} is not divisible by tensor_parallel.size={tp}; sequence "
                             f"parallelism splits the sequence, so choose a seq_len that is a multiple of {tp}")
        if sequence_parallel and cfg.moe:
            raise ValueError("GPT: sequence_parallel with model.moe is not supported: the experts are replicated "
                             "over tp and need every tp rank's tokens; turn sequence_parallel off")
        plan = dict(PLAN)
        if all(not isinstance(b.mlp, MLP) for b in self.blocks):  # every MLP is an MoE: experts stay whole
            for pattern in MLP_PATTERNS:
                del plan[pattern]
        apply_plan(self, plan, mesh, sequence_parallel=sequence_parallel, logger=logger)
        self.tp, self.sequence_parallel = TPHandle(mesh, logger), sequence_parallel
        device = self.lm_head.weight.device
        if device.type == "meta":  # shapes only: the streams live where real tensors will, the host by default
            device = torch.device("cpu")
        self.rng_tracker = RNGTracker.for_mesh(torch.initial_seed() if rng_seed is None else rng_seed, mesh, device)
        local_heads = cfg.n_head // tp
        heads = range(mesh.tp_rank * local_heads, (mesh.tp_rank + 1) * local_heads)
        for i, block in enumerate(self.blocks):
            block.attn.head_rng = self.rng_tracker.unit_generators(f"blocks.{i}.attn", heads)
        if sequence_parallel:
            self._shard_sequence(mesh, logger)

    def parallelize_context(self, cp) -> None:
        """Split every sequence over `cp`'s ranks (a trident.context_parallel.ContextParallel).

        Each rank then embeds, transforms and scores only its chunks of the sequence, at their
        global positions; attention reaches the other chunks through the ring or Ulysses, and
        the loss is the mean over every token of the sequence. Attention dropout has no
        context-parallel form here and is refused.
        """
        cfg = self.config
        if cfg.dropout > 0:
            raise ValueError(f"GPT: dropout={cfg.dropout} under context parallelism is not supported (ring and "
                             f"Ulysses attention have no attention dropout); set model dropout to 0 or "
                             f"context_parallel.size to 1")
        if getattr(cfg, "moe", None):
            raise ValueError("GPT: context parallelism with mixture-of-experts blocks (model.moe) is not supported: "
                             "routing capacity and the auxiliary losses are defined over whole sequences of the "
                             "data-parallel ranks; set context_parallel.size to 1 or use a dense model")
        cp.check_length(cfg.seq_len, "GPT's seq_len")
        heads = cfg.n_head // (self.tp.size if self.tp is not None else 1)
        if cp.method != "ring" and heads % cp.ulysses_size:
            raise ValueError(f"GPT: {heads} attention heads per tensor-parallel rank are not divisible by the "
                             f"Ulysses size {cp.ulysses_size}; Ulysses splits heads, so choose "
                             f"context_parallel.size (or ulysses_size) dividing {heads}, or method 'ring'")
        self.cp = cp
        for block in self.blocks:
            block.attn.cp = cp

    def _shard_sequence(self, mesh, logger: CommsLogger | None) -> None:
        """Sequence parallelism: position slices, sliced dropout masks, LayerNorm grads summed over tp."""
        self.embed.seq_shard = (mesh.tp_rank, mesh.tp_size)
        p = self.config.dropout
        self.embed.drop = SequenceParallelDropout(p, mesh)
        replicated = [self.embed.wpe.weight, *self.ln_f.parameters()]
        for block in self.blocks:
            block.attn.resid_drop = SequenceParallelDropout(p, mesh)
            block.mlp.drop = SequenceParallelDropout(p, mesh)
            replicated += [*block.ln_1.parameters(), *block.ln_2.parameters()]
        for param in replicated:
            mark_sequence_parallel(param, mesh, logger)

    def tie_weights(self) -> None:
        """Share the token embedding with the output projection (when `tie_embeddings`)."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.embed.wte.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 init, drawn in parameter order so the same seed gives the same weights.

        Weights ~ N(0, init_std); the two projections that write into the residual stream
        (`attn.proj`, `mlp.proj`) use init_std / sqrt(2 * n_layer), so the residual's variance
        does not grow with depth. Biases 0, LayerNorm scales 1.
        """
        residual_std = self.config.init_std / math.sqrt(2 * self.config.n_layer)
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif ".ln_" in name or name.startswith("ln_f"):
                nn.init.ones_(param)
            elif name.endswith(("attn.proj.weight", "mlp.proj.weight")) or (".experts." in name
                                                                            and name.endswith(".proj.weight")):
                nn.init.normal_(param, mean=0.0, std=residual_std)
            else:
                nn.init.normal_(param, mean=0.0, std=self.config.init_std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *,
                position_ids: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """idx [B, T] token ids -> logits [B, T, V], or the mean cross-entropy if `targets`.

        Packed sequences pass `position_ids` (restarting at 0 in each document) and `doc_ids`
        (blocking attention across documents); targets that cross a document boundary should
        be -100 so the loss ignores them. Then a packed row trains exactly like its documents
        run one by one."""
        if idx.shape[1] > self.config.seq_len:
            raise ValueError(f"input has {idx.shape[1]} tokens but the model's seq_len is "
                             f"{self.config.seq_len}; truncate the input or build a longer model")
        if self.sequence_parallel and idx.shape[1] % self.tp.size:
            raise ValueError(f"input has {idx.shape[1]} tokens, not divisible by tp={self.tp.size}; "
                             f"sequence parallelism splits the sequence evenly, so pad or truncate the input")
        if self.cp is not None:
            return self._forward_context_parallel(idx, targets, position_ids, doc_ids)
        x = self.embed(idx, position_ids)
        for block in self.blocks:
            x = block(x) if doc_ids is None else block(x, doc_ids)
        logits = self.lm_head(self.ln_f(x))
        if self.tp is None:
            return logits if targets is None else self.loss(logits, targets) + self.moe_loss()
        if targets is None:  # this rank holds a slice of the (padded) vocabulary: gather and trim
            return gather_from_tp_region(logits, self.tp.group, self.tp.logger)[..., :self.config.vocab_size]
        return vocab_parallel_cross_entropy(logits, targets, self.tp.group, vocab_size=self.config.vocab_size,
                                            logger=self.tp.logger) + self.moe_loss()

    def moe_loss(self) -> torch.Tensor | float:
        """The MoE blocks' auxiliary losses of the last forward, summed (0.0 for a dense model)."""
        losses = [b.aux_loss for b in self.blocks.modules() if isinstance(b, Block) and b.aux_loss is not None]
        return sum(losses[1:], losses[0]) if losses else 0.0

    def _forward_context_parallel(self, idx, targets, position_ids, doc_ids) -> torch.Tensor:
        """The forward on this cp rank's chunks of every sequence (full-length inputs in)."""
        cp, t = self.cp, idx.shape[1]
        cp.check_length(t)
        if self.sequence_parallel and (t // cp.size) % self.tp.size:
            raise ValueError(f"input has {t} tokens: {t // cp.size} per cp rank, not divisible by tp="
                             f"{self.tp.size} for sequence parallelism; use a multiple of {cp.size * self.tp.size}")
        positions = torch.arange(t, device=idx.device) if position_ids is None else position_ids
        idx, positions = cp.shard(idx), cp.shard(positions, dim=-1)
        doc_ids = cp.shard(doc_ids) if doc_ids is not None else None
        x = self.embed(idx, positions)
        for block in self.blocks:
            x = block(x, doc_ids)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            if self.tp is not None:
                logits = gather_from_tp_region(logits, self.tp.group, self.tp.logger)[..., :self.config.vocab_size]
            return cp.unshard(logits.detach())
        targets = cp.shard(targets)
        if self.tp is None:
            total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                                    reduction="sum")
        else:
            total = vocab_parallel_cross_entropy(logits, targets, self.tp.group, vocab_size=self.config.vocab_size,
                                                 logger=self.tp.logger, reduction="sum")
        return cp.global_mean(total, (targets != -100).sum())

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over all positions; targets of -100 are ignored."""
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Distinct parameters held by this process (a tied weight counts once; tp shards locally).

        With `exclude_embeddings`, the token and position tables are left out (Kaplan et al.'s
        non-embedding count); an untied `lm_head` still counts.
        """
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self.embed.wte.weight.numel() + self.embed.wpe.weight.numel()
        return total
