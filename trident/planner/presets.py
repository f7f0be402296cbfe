"""Shapes of known models and the constants of known GPUs: what the planner's formulas read.

A `ModelSpec` is a decoder-only transformer described by the numbers that set its memory, its
FLOPs and its traffic; a `GPUSpec` is one accelerator and the links around it; a `Cluster` is
N of them in nodes of K. Every number below comes from the cited paper, model card or data
sheet; none is fitted to a benchmark (bench/planner_vs_published.py compares the planner's
predictions with published runs using exactly these constants).

A GPT shape (learned positions, LayerNorm, biases, tied embeddings: trident's reference GPT) is
described once, as the models package's `trident.models.gpt.GPTConfig`; the planner reads one
through `model_from_gpt_config`, and takes trident's own sizes from `GPT_PRESETS` there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from trident.models.gpt import GPT_PRESETS, PUBLISHED_VOCAB, GPTConfig
from trident.planner.gemm import GemmCurve, GemmTable

GiB = 1024**3
BUNDLED_VOCAB = 4096  # trident/data/corpus/tokenizer.json: the vocabulary of trident's own presets


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer: enough to count its parameters, FLOPs and activations.

    `n_kv_head` < `n_head` is grouped-query attention; `gated_mlp` is SwiGLU-style (three
    d_model x d_ff matrices instead of two); `position="learned"` adds a seq_len x d_model table.
    """

    name: str
    n_layer: int
    d_model: int
    n_head: int
    vocab_size: int
    seq_len: int
    d_ff: int | None = None
    n_kv_head: int | None = None
    gated_mlp: bool = False
    bias: bool = True
    tie_embeddings: bool = True
    position: Literal["learned", "rotary", "alibi"] = "learned"
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    embed_norm: bool = False
    num_experts: int = 0          # mixture of experts: experts per MoE layer; 0 = dense
    moe_k: int = 1                # experts each token visits
    moe_every_n_layers: int = 1   # blocks every_n - 1, 2 every_n - 1, ... are MoE

    def __post_init__(self) -> None:
        for key in ("n_layer", "d_model", "n_head", "vocab_size", "seq_len"):
            if getattr(self, key) < 1:
                raise ValueError(f"model {self.name!r}: {key} must be >= 1, got {getattr(self, key)}")
        if self.d_model % self.n_head:
            raise ValueError(f"model {self.name!r}: d_model={self.d_model} is not divisible by "
                             f"n_head={self.n_head}; choose d_model as a multiple of n_head")
        if self.n_head % self.kv_heads:
            raise ValueError(f"model {self.name!r}: n_head={self.n_head} is not divisible by "
                             f"n_kv_head={self.kv_heads}; query heads must share key/value heads evenly")

    @property
    def ff_dim(self) -> int:
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head if self.n_kv_head is not None else self.n_head

    @property
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection."""
        return self.kv_heads * (self.d_model // self.n_head)

    def _norm_params(self) -> int:
        return self.d_model * (2 if self.norm == "layernorm" and self.bias else 1)

    @property
    def moe_layers(self) -> int:
        """Blocks whose MLP is a mixture of experts."""
        return self.n_layer // self.moe_every_n_layers if self.num_experts else 0

    def mlp_parameters(self) -> int:
        """One MLP (one expert of an MoE layer)."""
        h, ff, b = self.d_model, self.ff_dim, int(self.bias)
        return (3 * h * ff if self.gated_mlp else 2 * h * ff) + b * (ff + h)

    def expert_parameters(self) -> int:
        """Every expert of every MoE layer (what expert parallelism splits over ep)."""
        return self.moe_layers * self.num_experts * self.mlp_parameters()

    def _moe_extra(self, experts: int) -> int:
        """What MoE layers add over dense ones when `experts` MLPs count: the router (d_model x E)
        and experts - 1 more MLPs per MoE layer."""
        return self.moe_layers * ((experts - 1) * self.mlp_parameters() + self.d_model * self.num_experts)

    def layer_parameters(self) -> int:
        """One (dense) transformer block: two norms, attention (qkv + output) and the MLP."""
        h, ff, b = self.d_model, self.ff_dim, int(self.bias)
        attn = h * (h + 2 * self.kv_dim) + b * (h + 2 * self.kv_dim) + h * h + b * h
        mlp = (3 * h * ff if self.gated_mlp else 2 * h * ff) + b * (ff + h)
        return 2 * self._norm_params() + attn + mlp

    def embedding_parameters(self) -> int:
        """Token table, learned positions, embedding norm, final norm and an untied output layer."""
        n = self.vocab_size * self.d_model + self._norm_params()
        if self.position == "learned":
            n += self.seq_len * self.d_model
        if self.embed_norm:
            n += self._norm_params()
        if not self.tie_embeddings:
            n += self.vocab_size * self.d_model
        return n

    def num_parameters(self) -> int:
        """All distinct parameters (a tied output layer counts once; every expert)."""
        return self.n_layer * self.layer_parameters() + self.embedding_parameters() + self._moe_extra(self.num_experts)

    def active_parameters(self) -> int:
        """Parameters one token passes through: an MoE layer counts its router and k experts."""
        return (self.n_layer * self.layer_parameters() + self.embedding_parameters()
                + self._moe_extra(self.moe_k))

    def forward_flops_per_token(self, seq_len: int) -> tuple[float, float, float]:
        """Forward matmul FLOPs per token: (layer matmuls, attention scores, logits), all layers.

        Attention counts QK^T and AV over the whole sequence (not halved for the causal mask), as
        Narayanan et al. 2021 and Chowdhery et al. 2022 (PaLM, appendix B) do, so MFU figures compare.
        """
        h, ff = self.d_model, self.ff_dim
        dense = 2 * (h * (h + 2 * self.kv_dim) + h * h + (3 if self.gated_mlp else 2) * h * ff)
        scores = 2 * 2 * seq_len * h
        mlp = 2 * (3 if self.gated_mlp else 2) * h * ff
        moe = self.moe_layers * ((self.moe_k - 1) * mlp + 2 * h * self.num_experts)  # k experts + the router
        return self.n_layer * dense + moe, self.n_layer * scores, 2 * h * self.vocab_size

    def model_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token without recomputation: forward + backward (2x forward)."""
        return 3 * sum(self.forward_flops_per_token(seq_len))

    def describe(self) -> str:
        moe = (f", {self.moe_layers} MoE layers of {self.num_experts} experts (top-{self.moe_k}, "
               f"{self.active_parameters() / 1e9:.3g}B active)" if self.num_experts else "")
        return (f"{self.name}: {self.num_parameters() / 1e9:.3g}B parameters, {self.n_layer} layers, d_model "
                f"{self.d_model}, {self.n_head} heads, vocab {self.vocab_size}, seq_len {self.seq_len}{moe}")


def model_from_gpt_config(cfg: GPTConfig, name: str = "trident-gpt") -> ModelSpec:
    """The ModelSpec of trident's reference GPT built from a `trident.models.gpt.GPTConfig`."""
    moe = getattr(cfg, "moe", None)
    experts = dict(num_experts=moe.num_experts, moe_k=moe.k, moe_every_n_layers=moe.every_n_layers) if moe else {}
    return ModelSpec(name, cfg.n_layer, cfg.d_model, cfg.n_head, cfg.vocab_size, cfg.seq_len, d_ff=cfg.d_ff,
                     bias=cfg.bias, tie_embeddings=cfg.tie_embeddings, **experts)


def _gpt(name: str, vocab: int | None = None) -> ModelSpec:
    """A GPT shape of `GPT_PRESETS` (the models package's one table of them), with its published
    vocabulary (`PUBLISHED_VOCAB`) or `vocab`."""
    return model_from_gpt_config(GPTConfig(vocab_size=vocab or PUBLISHED_VOCAB[name], **GPT_PRESETS[name]), name)


def _llama(name: str, n_layer: int, d_model: int, n_head: int, d_ff: int, seq: int = 2048, vocab: int = 32000,
           **kw) -> ModelSpec:
    return ModelSpec(name, n_layer, d_model, n_head, vocab, seq, d_ff=d_ff, gated_mlp=True, bias=False,
                     tie_embeddings=False, position="rotary", norm="rmsnorm", **kw)


MODEL_PRESETS: dict[str, ModelSpec] = {m.name: m for m in [
    # GPT-2, GPT-3, Megatron-Turing NLG 530B and OPT-175B: the reference GPT's shape, with their
    # sources beside the shapes in trident.models.gpt.GPT_PRESETS.
    *(_gpt(name) for name in PUBLISHED_VOCAB),
    # BLOOM (BigScience 2022, arXiv:2211.05100; bigscience train/tr11-176B-ml): ALiBi positions,
    # embedding LayerNorm, vocabulary 250680 padded to 250880 for tensor parallelism.
    ModelSpec("bloom-176b", 70, 14336, 112, 250880, 2048, position="alibi", embed_norm=True),
    # LLaMA (Touvron et al. 2023a, Table 2) and Llama 2 70B (Touvron et al. 2023b; its HF config).
    _llama("llama-7b", 32, 4096, 32, 11008),
    _llama("llama-13b", 40, 5120, 40, 13824),
    _llama("llama-65b", 80, 8192, 64, 22016),
    _llama("llama-70b", 80, 8192, 64, 28672, seq=4096, n_kv_head=8),
    # Llama 3.1 8B (Meta's HF config: 128256 tokens, 8 key/value heads, MLP 14336; torchtitan's
    # 8192-token training sequences).
    _llama("llama3-8b", 32, 4096, 32, 14336, seq=8192, vocab=128256, n_kv_head=8),
]}
# trident's own reference sizes (trident.models.gpt.GPT_PRESETS) with the bundled tokenizer.
MODEL_PRESETS.update({f"trident-{name}": model_from_gpt_config(GPTConfig(vocab_size=BUNDLED_VOCAB, **GPT_PRESETS[name]),
                                                                 f"trident-{name}")
                      for name in GPT_PRESETS if name not in PUBLISHED_VOCAB or name == "gpt2-124m"})


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator and its links. Bandwidths are per GPU, per direction, in bytes/s.

    `gemm_efficiency` is the share of `peak_flops` that large transformer matrix multiplies
    sustain; `memory_efficiency` the share of `hbm_bandwidth` that streaming element-wise
    kernels sustain. Both are device constants: the same for every model and layout. Smaller
    GEMMs run slower by `gemm_curve()`: the tile and wave quantization of `sms` multiprocessors
    and the memory roofline (`trident.planner.gemm`), or the rates `gemm_table` measured on
    this machine (`trident plan --calibrate`). `kernel_seconds` is the fixed cost of one
    kernel (launch and tail; on a CPU: one autograd op's dispatch); `host_op_seconds` what the
    host spends issuing one operator. `attention_rates` are a calibrated device's
    fused-attention rates.
    """

    name: str
    peak_flops: float            # dense 16-bit tensor-core FLOP/s
    memory_bytes: int
    hbm_bandwidth: float
    intra_node_bandwidth: float  # NVLink
    inter_node_bandwidth: float  # the GPU's share of the node's network adapters
    pcie_bandwidth: float        # host <-> device, for offload
    gpus_per_node: int = 8
    intra_node_latency: float = 3e-6
    inter_node_latency: float = 10e-6
    gemm_efficiency: float = 0.75
    memory_efficiency: float = 0.8
    sms: int = 108
    kernel_seconds: float = 4e-6
    host_op_seconds: float = 12e-6
    """Host time to dispatch one eager operator (Python, the dispatcher, the launch call). The
    host issues a step's operators while the GPU runs earlier ones, so a step takes at least
    ops x this: a small model's step is host-bound (the H200 of 2026-11-27 dispatched about one
    operator per 13.6 us). 0 on a CPU, where the dispatch is part of each op's `kernel_seconds`."""
    gemm_depth: tuple[tuple[int, float], ...] = ()
    """(k, rate relative to k = 4096) of large-output GEMMs by reduction depth, measured on this
    GPU (`trident.planner.gemm`); empty where no measurement is published (the tile and wave
    model alone)."""
    gemm_table: GemmTable | None = None
    fp8_peak_flops: float | None = None
    """Dense FP8 tensor-core FLOP/s (the data sheet's, without sparsity); None: no FP8 units, so
    an `fp8` workload's GEMMs go at the 16-bit rate (torchao's emulation is no faster)."""
    attention_rates: tuple[tuple[int, float], ...] = ()
    """(head width, FLOP/s) of the fused attention kernel, forward and backward, as measured here;
    empty: the published Hopper rates where `hopper_attention`, else its GEMMs go at the GEMM
    curve's rate."""
    hopper_attention: bool = False
    """Flash attention goes at the published Hopper shares of peak for the kernels that run it
    (`trident.planner.kernels.FLASH_ATTENTION_SHARE`)."""

    def gemm_curve(self) -> GemmTable | GemmCurve:
        """Seconds of a GEMM by shape: the measured table when there is one, else the published curve."""
        if self.gemm_table is not None:
            return self.gemm_table
        return GemmCurve(self.peak_flops, self.gemm_efficiency, self.sms, self.hbm_bandwidth * self.memory_efficiency,
                         self.kernel_seconds, self.gemm_depth)

    def fp8_gemm_curve(self) -> GemmCurve | None:
        """The published curve at the FP8 peak (same sustained share, tiles and depth table as the
        16-bit one); None on a device without FP8 units or priced by a measured 16-bit table."""
        if self.fp8_peak_flops is None or self.gemm_table is not None:
            return None
        return replace(self.gemm_curve(), peak_flops=self.fp8_peak_flops)


# Peak FLOP/s, memory, HBM and NVLink bandwidths are NVIDIA's data sheets (V100, A100, H100,
# H200 SXM; dense, without sparsity). FP8: H100 and H200 SXM 1979 TFLOP/s dense (3958 with
# sparsity); V100 and A100 have no FP8 tensor cores. NVLink: V100 300 GB/s, A100 600 GB/s, H100/H200 900 GB/s
# total, i.e. half of that each way. Networks are those of the DGX reference nodes: DGX-1 has
# 4 x 100 Gb/s EDR for 8 V100, DGX A100 8 x 200 Gb/s HDR, DGX H100 8 x 400 Gb/s NDR for 8 GPUs.
# PCIe: gen3/4/5 x16 at about 80% of the 16/32/64 GB/s link rate. Latencies: a few us per hop
# inside a node and about 10 us across InfiniBand, the usual alpha of NCCL's small messages.
# Sustained GEMM shares: cuBLAS reaches about 75% of peak on large 16-bit GEMMs on V100 and A100
# and about 70% on H100 (whose peak is harder to feed) inside training steps. The best single
# GEMM measured in isolation is higher: the "Maximum Achievable Matmul FLOPS" table of Bekman's
# ML Engineering book (stas00/ml-engineering, compute/accelerator/README.md; mamf-finder.py,
# after Anthony et al. 2024, "The Case for Co-Designing Model Architectures with Hardware",
# arXiv:2401.14489) lists A100 SXM bf16 at 271.2 of 312 TFLOP/s (86.9%, best shape 1024 x
# 10240 x 5120) and H100 SXM at 794.5 of 989 (80.3%); the training shares here sit about 12%
# below those ceilings (clocks under sustained load, other kernels between GEMMs). How smaller
# shapes fall off is the tile and wave quantization of NVIDIA's "Matrix Multiplication
# Background User's Guide" (DU-09799-001, 2023): 80 SMs on V100, 108 on A100, 132 on H100/H200,
# output tiles of 256 x 128 down to 64 x 64 (`trident.planner.gemm`); Anthony et al. measure
# the same effect on transformer GEMMs (hidden sizes that leave a partial wave lose up to ~40%).
#
# By reduction depth (`gemm_depth`): OpenXLA's measured matmul table for sm_90 (H100; openxla/xla
# xla/service/gpu/model/matmul_interpolator_data.h, as vendored in tensorflow/tensorflow, bf16,
# batch 1) gives m = n = 4096 GEMMs 392.2, 543.1, 677.4, 738.7 and 783.3 TFLOP/s at k = 256, 512,
# 1024, 2048 and 4096: 0.50, 0.69, 0.86, 0.94 and 1 of the deepest. H200 has the same SMs and
# clocks. No such table is published for A100 or V100 that we found: theirs stays the tile and
# wave model alone (Narayanan et al.'s smallest Table 1 runs, k >= 1152, are predicted within
# 7% with it; bench/planner_vs_published.py).
H100_GEMM_DEPTH = ((256, 392.2 / 783.3), (512, 543.1 / 783.3), (1024, 677.4 / 783.3), (2048, 738.7 / 783.3),
                   (4096, 1.0))
GPU_PRESETS: dict[str, GPUSpec] = {g.name: g for g in [
    GPUSpec("v100-32gb", 125e12, 32 * GiB, 900e9, 150e9, 6.25e9, 12e9, sms=80),
    GPUSpec("a100-40gb", 312e12, 40 * GiB, 1555e9, 300e9, 25e9, 25e9),
    GPUSpec("a100-80gb", 312e12, 80 * GiB, 2039e9, 300e9, 25e9, 25e9),
    GPUSpec("h100-80gb", 989e12, 80 * GiB, 3350e9, 450e9, 50e9, 50e9, gemm_efficiency=0.70, sms=132,
            gemm_depth=H100_GEMM_DEPTH, fp8_peak_flops=1979e12, hopper_attention=True),
    # torchtitan's Grand Teton H100 (benchmarks/llama3_h100_202412_torchtitan.md): SXM with 96 GB
    # of HBM2e at 2.4 TB/s, run at the default 500 W; "the actual peak TFLOPs number is between SXM
    # and NVL, and we don't know its exact value" (its footnote 2). The preset takes the midpoint
    # of the data sheets' dense figures, SXM 989 / NVL 835 TFLOP/s bf16 and 1979 / 1670 FP8; 94 GiB
    # usable (torchtitan's docs/performance.md: "H100 (94GB memory)").
    GPUSpec("h100-96gb-500w", (989e12 + 835e12) / 2, 94 * GiB, 2400e9, 450e9, 50e9, 50e9, gemm_efficiency=0.70,
            sms=132, gemm_depth=H100_GEMM_DEPTH, fp8_peak_flops=(1979e12 + 1670e12) / 2, hopper_attention=True),
    # nvidia-smi reports 143771 MiB (140 GiB) for the "141 GB" H200.
    GPUSpec("h200-141gb", 989e12, 140 * GiB, 4800e9, 450e9, 50e9, 50e9, gemm_efficiency=0.70, sms=132,
            gemm_depth=H100_GEMM_DEPTH, fp8_peak_flops=1979e12, hopper_attention=True),
]}


@dataclass(frozen=True)
class Cluster:
    """`num_gpus` GPUs of one kind in nodes of `gpus_per_node`; host memory and NVMe per node."""

    gpu: GPUSpec
    num_gpus: int
    gpus_per_node: int
    host_memory_bytes: int = 1024 * GiB
    nvme_bytes: int = 15 * 1024 * GiB
    calibration: Any = None  # a trident.planner.cluster.Calibration: measured collectives and costs

    def __post_init__(self) -> None:
        if self.num_gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(f"a cluster needs num_gpus >= 1 and gpus_per_node >= 1, got {self.num_gpus} "
                             f"and {self.gpus_per_node}")

    @property
    def num_nodes(self) -> int:
        return -(-self.num_gpus // self.gpus_per_node)


def make_cluster(gpu: str | GPUSpec, num_gpus: int, gpus_per_node: int | None = None, **overrides: Any) -> Cluster:
    """A cluster of a preset GPU (or a GPUSpec); `overrides` replace GPUSpec fields (e.g. a network)."""
    spec = gpu_preset(gpu) if isinstance(gpu, str) else gpu
    if overrides:
        spec = replace(spec, **overrides)
    return Cluster(spec, num_gpus, gpus_per_node or min(spec.gpus_per_node, num_gpus))


def gpu_preset(name: str) -> GPUSpec:
    try:
        return GPU_PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; choose one of {', '.join(GPU_PRESETS)}") from None


def model_preset(name: str) -> ModelSpec:
    try:
        return MODEL_PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose a preset ({', '.join(MODEL_PRESETS)}), a Hugging "
                         f"Face-style config.json, or give --layers --hidden --heads --vocab") from None


_HF_KEYS: dict[str, tuple[str, ...]] = {
    "n_layer": ("n_layer", "num_hidden_layers", "num_layers"),
    "d_model": ("n_embd", "hidden_size", "d_model"),
    "n_head": ("n_head", "num_attention_heads"),
    "vocab_size": ("vocab_size",),
}


def model_from_hf_config(source: str | Path | dict, seq_len: int | None = None) -> ModelSpec:
    """A ModelSpec from a Hugging Face-style config (a path to config.json, or its dict)."""
    data = source if isinstance(source, dict) else json.loads(Path(source).read_text())
    fallback = "model" if isinstance(source, dict) else Path(source).stem
    name = str(data.get("_name_or_path") or data.get("model_type") or fallback)
    found: dict[str, int] = {}
    for key, names in _HF_KEYS.items():
        value = next((data[n] for n in names if data.get(n) is not None), None)
        if value is None:
            raise ValueError(f"model config {name!r} has none of the keys {', '.join(names)}; a Hugging "
                             f"Face-style config needs them to give the model's {key}")
        found[key] = int(value)
    seq = seq_len or data.get("max_position_embeddings") or data.get("n_positions") or data.get("seq_length") or 2048
    gated = data.get("hidden_act", data.get("activation_function", "gelu")) in ("silu", "swiglu", "swish")
    return ModelSpec(name, seq_len=int(seq), d_ff=data.get("intermediate_size") or data.get("n_inner"),
                     n_kv_head=data.get("num_key_value_heads"), gated_mlp=gated,
                     bias=not gated, tie_embeddings=bool(data.get("tie_word_embeddings", not gated)),
                     position="rotary" if "rope_theta" in data or gated else "learned",
                     norm="rmsnorm" if "rms_norm_eps" in data else "layernorm", **found)


__all__ = ["BUNDLED_VOCAB", "Cluster", "GPUSpec", "GPU_PRESETS", "GiB", "MODEL_PRESETS", "ModelSpec",
           "gpu_preset", "make_cluster", "model_from_gpt_config", "model_from_hf_config", "model_preset"]
