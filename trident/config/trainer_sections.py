"""Config sections of trident's built-in trainer (`trident train`; `trident.initialize` ignores
them): the model to build, the data to read, the training loop.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from trident.config.errors import rule_error
from trident.config.section import Section


# -- trident's built-in trainer (`trident train`; ignored by trident.initialize) ------------------

class MoEModelConfig(Section):
    """`model.moe`: make every `every_n_layers`-th block's MLP a mixture of experts (`trident.moe.MoE`)."""

    num_experts: int = Field(8, gt=0, description="Experts per MoE layer (a multiple of expert_parallel.size).")
    k: int = Field(2, gt=0, description="Experts each token visits (top-k).")
    every_n_layers: int = Field(1, gt=0, description="Blocks every_n_layers - 1, 2 x every_n_layers - 1, ... are MoE.")
    capacity_factor: float = Field(1.0, gt=0, description="Slots per expert = ceil(tokens / experts x factor x k).")
    eval_capacity_factor: float = Field(1.0, gt=0, description="capacity_factor in evaluation.")
    min_capacity: int = Field(4, ge=0, description="Slots per expert at least.")
    drop_tokens: bool = Field(True, description="Drop choices past capacity; false = dropless.")
    aux_loss_coef: float = Field(0.01, ge=0, description="Weight of the load-balancing loss in the training loss.")
    z_loss_coef: float = Field(0.0, ge=0, description="Weight of the router z-loss in the training loss.")

    @model_validator(mode="after")
    def _k_fits(self) -> MoEModelConfig:
        if self.k > self.num_experts:
            raise rule_error(f"k={self.k} is larger than num_experts={self.num_experts}; each token picks k "
                             "distinct experts, so choose k <= num_experts")
        return self


class ModelConfig(Section):
    """The model `trident train` builds; explicit sizes override the preset's."""

    type: Literal["gpt"] = Field("gpt", description="Model family; trident's reference GPT.")
    preset: str | None = Field(None, description="A named size from trident.models.gpt.GPT_PRESETS.")
    n_layer: int | None = Field(None, gt=0, description="Transformer blocks.")
    n_head: int | None = Field(None, gt=0, description="Attention heads per block.")
    d_model: int | None = Field(None, gt=0, description="Width of the residual stream.")
    seq_len: int | None = Field(None, gt=0, description="Tokens per training sequence (context length).")
    d_ff: int | None = Field(None, gt=0, description="Hidden width of the MLP; null = 4 x d_model.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout probability.")
    bias: bool = Field(True, description="Bias terms in linear layers and layer norms.")
    tie_embeddings: bool = Field(True, description="Share the token embedding with the output layer.")
    moe: MoEModelConfig | None = Field(None, description="Mixture-of-experts MLPs; null = dense.")


class DataConfig(Section):
    """The data `trident train` trains on: prepared `.bin`/`.idx` shards (`trident data prepare`)."""

    dataset: str = Field("kjv", description=(
        '"kjv" (the bundled corpus) or a UTF-8 text file (one document per line); used when `paths` is '
        "null, prepared into ~/.cache/trident/data on first use."))
    tokenizer: str | None = Field(None, description="Path to a tokenizers JSON file; null = the bundled one.")
    paths: list[str] | None = Field(None, description=(
        "Prepared data: folders of .bin/.idx shards or shard prefixes, one corpus each; null = `dataset`."))
    weights: list[float] | None = Field(None, description=(
        "Share of samples drawn from each of `paths` (normalised; exact within one sample at every prefix); "
        "null = proportional to their sizes."))
    seq_len: int | None = Field(None, gt=0, description="Tokens per training sequence; null = model.seq_len.")
    packing: bool = Field(False, description=(
        "Pack whole documents into each sequence; position ids restart and attention is blocked at "
        "document boundaries, so a packed row trains like its documents one by one."))
    bucketing: bool = Field(False, description=(
        "One document per sample, batched with documents of similar length under max_tokens_per_batch."))
    max_tokens_per_batch: int | None = Field(None, gt=0, description=(
        "With bucketing: padded tokens per micro-batch (instead of a sample count); null = micro batch x seq_len."))
    loss_normalization: Literal["tokens", "micro_batch"] | None = Field(None, description=(
        "How a step's gradient is normalized. \"tokens\": the sum of every counted token's loss gradient "
        "divided by the step's global count (summed over accumulation, data-parallel and context-parallel "
        "ranks), so any split of the same global batch gives the same update, and the logged loss is the "
        "global token mean. \"micro_batch\": the mean of the micro-batches' own means (DeepSpeed's). null: "
        "\"tokens\" with packing or bucketing (not under fp16), else \"micro_batch\" (engine.backward(loss, "
        "num_tokens=n) still weighs a window by the caller's counts)."))
    num_workers: int = Field(0, ge=0, description=(
        "Loader worker processes per rank (prefetching); 0 = read in the training process, which on CPU is "
        "cheaper: a memory-mapped sample costs microseconds, a worker's hand-over milliseconds."))
    seed: int | None = Field(None, description="Seed of the data order; null = the top-level `seed`.")
    shuffle: bool = Field(True, description="Reshuffle the training sequences every epoch.")
    drop_last: bool = Field(True, description=(
        "Kept for old configs; the stream of samples runs on across epochs, so no batch is incomplete."))
    val_fraction: float = Field(0.01, ge=0, lt=1, description="Share of the documents held out for validation.")

    @model_validator(mode="after")
    def _consistent(self) -> DataConfig:
        problems = []
        if self.weights is not None:
            if self.paths is None or len(self.weights) != len(self.paths):
                problems.append(f"weights has {len(self.weights)} entries for "
                                f"{0 if self.paths is None else len(self.paths)} paths; give one weight per path")
            elif any(w < 0 for w in self.weights) or not sum(self.weights) > 0:
                problems.append(f"weights {self.weights} must be non-negative and sum to a positive number (they "
                                f"sum to {sum(self.weights)}); they are normalised, so [3, 1] draws 75% from "
                                f"the first path")
        if self.paths is not None and not self.paths:
            problems.append("paths is empty; give at least one folder or shard prefix, or null")
        if self.packing and self.bucketing:
            problems.append("packing and bucketing are both true; packing fills fixed rows with whole documents, "
                            "bucketing batches single documents by length: choose one")
        if self.max_tokens_per_batch is not None and not self.bucketing:
            problems.append("max_tokens_per_batch is set but bucketing is false; it only applies to bucketed "
                            "batches: set bucketing to true or remove it")
        if problems:
            raise rule_error("; ".join(problems))
        return self


class TrainerConfig(Section):
    """Length, logging and checkpointing of a `trident train` run."""

    train_steps: int = Field(150, gt=0, description="Optimizer steps to run.")
    run_dir: str = Field("runs", description="Folder that holds one sub-folder per run.")
    run_name: str | None = Field(None, description="Name of this run's folder; null = a timestamp.")
    save_interval: int = Field(0, ge=0, description="Save a checkpoint every N steps; 0 = only at the end.")
    log_interval: int = Field(1, gt=0, description="Write metrics every N steps.")
