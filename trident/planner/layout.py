"""What the planner is asked about: a parallel layout, and the training run it serves.

`Layout` is one point of the search space (dp x tp x pp ranks, ZeRO stage, offload,
activation checkpointing, sequence parallelism, micro-batch, pipeline schedule). `Workload` is
what does not change between layouts: sequence length, global batch, precision, optimizer.
`layout_problems` says why a layout is invalid for a model and a world size, in words a user
can act on; the search and `estimate` both use it, so neither proposes what the other rejects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trident.planner.presets import ModelSpec

Checkpointing = Literal["none", "selective", "full"]
Offload = Literal["none", "cpu", "nvme"]
Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zb_h1"]
Precision = Literal["bf16", "fp16", "fp32"]

LORA_TARGETS = ("q", "k", "v", "qkv", "o", "mlp")
"""Linear layers of a block LoRA can adapt: separate or fused query/key/value projections, the
attention output, every matrix of the MLP."""
DEFAULT_LORA_TARGETS = ("qkv", "o", "mlp")
"""What `lora.target_modules`' default (qkv, proj, fc) adapts on trident's reference GPT."""


@dataclass(frozen=True)
class Layout:
    """One way to run a model on dp * tp * pp ranks (tp innermost, as trident's mesh orders them)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    micro_batch: int = 1
    activation_checkpointing: Checkpointing = "none"
    sequence_parallel: bool = False
    offload_optimizer: Offload = "none"
    offload_params: Offload = "none"
    schedule: Schedule = "1f1b"
    virtual_stages: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def describe(self) -> str:
        """`dp8 tp4 pp12 zero1 mb2 ckpt=full sp offload=cpu/none 1f1b`-style summary."""
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}", f"zero{self.zero_stage}", f"mb{self.micro_batch}"]
        if self.activation_checkpointing != "none":
            parts.append(f"ckpt={self.activation_checkpointing}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.offload_optimizer != "none" or self.offload_params != "none":
            parts.append(f"offload={self.offload_optimizer}/{self.offload_params}")
        if self.pp > 1:
            parts.append(self.schedule + (f"x{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        return " ".join(parts)


@dataclass(frozen=True)
class Workload:
    """The training run: tokens per sequence, sequences per optimizer step, number formats.

    `attention="flash"` keeps no seq x seq score matrix (a fused kernel); `"eager"` stores the
    softmax and its dropout as Korthikanti et al. 2022 count them. `lora_r` > 0 fine-tunes
    with LoRA adapters of that rank on `lora_targets` (see `LORA_TARGETS`): the model is
    frozen, only the adapters have gradients, optimizer states, gradient traffic and an
    optimizer step. Compute is still priced as full training: the frozen weights' skipped
    weight-gradient GEMMs (about a third of the FLOPs) are counted and the adapters' own small
    GEMMs are not, so a LoRA step time errs on the slow side.
    """

    seq_len: int
    global_batch: int
    precision: Precision = "bf16"
    optimizer: str = "adam"
    attention: Literal["flash", "eager"] = "flash"
    dropout: bool = False
    reduce_bucket_elems: int = 500_000_000
    lora_r: int = 0
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS

    def __post_init__(self) -> None:
        if isinstance(self.lora_r, bool) or not isinstance(self.lora_r, int) or self.lora_r < 0:
            raise ValueError(f"lora_r must be a non-negative integer (0 = full fine-tuning), got {self.lora_r!r}")
        if self.lora_r:
            unknown = [t for t in self.lora_targets if t not in LORA_TARGETS]
            if unknown or not self.lora_targets:
                raise ValueError(f"lora_targets {list(self.lora_targets)}: each must be one of "
                                 f"{', '.join(LORA_TARGETS)} (and at least one)")
            if "qkv" in self.lora_targets and {"q", "k", "v"} & set(self.lora_targets):
                raise ValueError(f"lora_targets {list(self.lora_targets)}: 'qkv' is the fused q, k and v "
                                 "projection; name either it or q/k/v, not both")

    @property
    def activation_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch


def grad_accumulation(layout: Layout, workload: Workload) -> int | None:
    """Micro-batches per optimizer step on each data-parallel rank, or None if not whole."""
    per_step = layout.dp * layout.micro_batch
    return workload.global_batch // per_step if workload.global_batch % per_step == 0 else None


def stage_layers(model: ModelSpec, pp: int) -> int:
    """Transformer layers on the busiest pipeline stage (an uneven split rounds up)."""
    return -(-model.n_layer // pp)


def layout_problems(model: ModelSpec, layout: Layout, workload: Workload, world_size: int | None = None,
                    even_stages: bool = True) -> list[str]:
    """Why `layout` cannot run `model`; empty when it can (memory is judged separately).

    `even_stages=False` accepts pipeline stages of unequal depth (the planner then costs the
    busiest one), as hand-partitioned published runs use; the search always asks for even ones.
    """
    problems = []
    if world_size is not None and layout.world_size != world_size:
        problems.append(f"dp {layout.dp} x tp {layout.tp} x pp {layout.pp} = {layout.world_size} ranks, "
                        f"not the {world_size} GPUs given; every GPU must hold one rank")
    if model.n_head % layout.tp:
        problems.append(f"tp {layout.tp} does not divide the {model.n_head} attention heads")
    elif model.kv_heads % layout.tp and layout.tp % model.kv_heads:
        problems.append(f"tp {layout.tp} and the {model.kv_heads} key/value heads do not divide one another")
    chunks = layout.pp * (layout.virtual_stages if layout.schedule == "interleaved_1f1b" else 1)
    if model.n_layer % chunks and (even_stages or chunks > model.n_layer):
        virtual = f" x {layout.virtual_stages} virtual stages" if chunks != layout.pp else ""
        problems.append(f"pp {layout.pp}{virtual} does not divide the {model.n_layer} layers")
    if layout.zero_stage not in (0, 1, 2, 3):
        problems.append(f"ZeRO stage {layout.zero_stage} does not exist; use 0, 1, 2 or 3")
    if layout.zero_stage > 1 and layout.pp > 1:
        problems.append(f"ZeRO stage {layout.zero_stage} with pipeline parallelism re-reduces gradients on every "
                        "micro-batch; use stage 0 or 1 with pp > 1 (as DeepSpeed requires)")
    if layout.offload_params != "none" and layout.zero_stage != 3:
        problems.append("parameter offload needs ZeRO stage 3 (only stage 3 partitions parameters)")
    if layout.offload_optimizer != "none" and layout.zero_stage == 0:
        problems.append("optimizer offload needs ZeRO stage >= 1 (stage 0 keeps the optimizer on the device)")
    if layout.sequence_parallel and layout.tp == 1:
        problems.append("sequence parallelism splits along the tensor-parallel group; it needs tp > 1")
    if layout.micro_batch < 1:
        problems.append(f"micro-batch {layout.micro_batch} must be >= 1")
    elif grad_accumulation(layout, workload) is None:
        problems.append(f"global batch {workload.global_batch} is not a multiple of dp {layout.dp} x micro-batch "
                        f"{layout.micro_batch}")
    if workload.seq_len > model.seq_len and model.position == "learned":
        problems.append(f"seq_len {workload.seq_len} exceeds the model's {model.seq_len} learned positions")
    return problems
