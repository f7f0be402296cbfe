"""Compressed communication, priced by its bytes: DeepSpeed's options by their config names.

Read from a DeepSpeed-style config (`compression_from_config`); nothing here runs a
compressor, so the planner does not depend on `trident.compression`.

- `optimizer.type` OneBitAdam / ZeroOneAdam / OneBitLamb: after `freeze_step` warm-up steps
  (ZeroOneAdam: `var_freeze_step`) at full size, the gradient (momentum) all-reduce carries one
  sign bit per element plus one fp32 scale per rank's chunk: about 1/32 of fp32. Error feedback
  keeps the compression error (at most the chunk's scale per element in one step) and adds it
  back on the next, so it does not accumulate (Tang et al. 2021, 1-bit Adam).
- `communication_data_type` "fp16"/"bf16": gradients reduced in 16 bits (half of fp32), each
  element rounded once (relative error 2^-11 for fp16, 2^-8 for bf16).
- ZeRO++ (Wang et al. 2023): `zero_quantized_weights` all-gathers stage-3 parameters in int8
  with one fp32 scale per block (`QUANT_BLOCK` elements; max error scale / 2, scale = max|w|
  / 127 of the block); `zero_quantized_gradients` reduce-scatters in int4 by two all-to-alls
  (inside the node, then across nodes; scale = max|g| / 7, error scale / 2 per hop);
  `zero_hpz_partition_size` keeps a secondary copy of the parameters partitioned inside groups
  of that many ranks (a node), so backward's gathers stay inside it.
- `fp8.all_gather` (trident, with `fp8.enabled` and ZeRO stage 3): the dense layers' weights
  (qkv, attention out, MLP in and out: the ones `fp8` converts) are all-gathered as float8, one
  byte per element, each scaled by its whole weight's amax (one small all-reduce per step, not
  priced).
"""

from __future__ import annotations

from dataclasses import dataclass

ONEBIT_OPTIMIZERS = {"onebitadam": "OneBitAdam", "zerooneadam": "ZeroOneAdam", "onebitlamb": "OneBitLamb"}
QUANT_BLOCK = 2048
"""Elements per quantization scale assumed for ZeRO++'s int8 weights and int4 gradients."""
DEFAULT_FREEZE_STEP = 100_000
"""DeepSpeed's default `freeze_step` (and ZeroOneAdam's `var_freeze_step`)."""


@dataclass(frozen=True)
class CommCompression:
    """Which compressed-communication options a config turns on."""

    onebit: str | None = None            # "OneBitAdam", "ZeroOneAdam" or "OneBitLamb"
    freeze_step: int = DEFAULT_FREEZE_STEP
    communication_data_type: str | None = None
    quantized_weights: bool = False
    quantized_gradients: bool = False
    hpz_partition_size: int = 1
    fp8_weights: bool = False  # fp8.all_gather: the dense layers' weights gathered as float8

    @property
    def active(self) -> bool:
        return bool(self.onebit or self.communication_data_type in ("fp16", "bf16") or self.quantized_weights
                    or self.quantized_gradients or self.hpz_partition_size > 1 or self.fp8_weights)


def compression_from_config(config: dict) -> CommCompression:
    """The compression a DeepSpeed-style config dict asks for (absent keys: off)."""
    opt = config.get("optimizer") or {}
    kind = ONEBIT_OPTIMIZERS.get(str(opt.get("type", "")).lower())
    params = opt.get("params") or {}
    freeze = params.get("var_freeze_step" if kind == "ZeroOneAdam" else "freeze_step", DEFAULT_FREEZE_STEP)
    zero = config.get("zero_optimization") or {}
    dtype = config.get("communication_data_type")
    if dtype is not None and str(dtype).lower() not in ("fp16", "bf16", "fp32"):
        raise ValueError(f"communication_data_type: {dtype!r} is not one of fp16, bf16, fp32")
    hpz = int(zero.get("zero_hpz_partition_size", 1) or 1)
    if hpz < 1:
        raise ValueError(f"zero_optimization.zero_hpz_partition_size: {hpz} must be >= 1")
    fp8 = config.get("fp8") or {}
    fp8_weights = bool(fp8.get("enabled") and fp8.get("all_gather") and zero.get("stage") == 3)
    return CommCompression(kind, int(freeze), str(dtype).lower() if dtype else None,
                           bool(zero.get("zero_quantized_weights", False)),
                           bool(zero.get("zero_quantized_gradients", False)), hpz, fp8_weights)


def onebit_bytes(elements: float, ranks: int) -> float:
    """One compressed all-reduce buffer: a sign bit per element and an fp32 scale per rank's chunk."""
    return elements / 8 + 4 * ranks


def gradient_bytes(c: CommCompression | None, elements: float, bytes_per: float, ranks: int,
                   warmup: bool = False) -> float:
    """Bytes of one gradient reduction buffer of `elements` under `c` (warm-up steps: uncompressed)."""
    if c is None:
        return elements * bytes_per
    if c.onebit and not warmup:
        return onebit_bytes(elements, ranks)
    if c.quantized_gradients:
        return elements / 2 + 4 * elements / QUANT_BLOCK
    if c.communication_data_type in ("fp16", "bf16"):
        return elements * min(bytes_per, 2)
    return elements * bytes_per


def parameter_gather_bytes(c: CommCompression | None, elements: float, bytes_per: float,
                           fp8: bool = False) -> float:
    """Bytes of one stage-3 parameter all-gather of `elements` (int8 + scales under qwZ; one
    byte each for a dense layer's weight, `fp8`, under fp8.all_gather)."""
    if fp8 and c is not None and c.fp8_weights:
        return elements
    if c is not None and c.quantized_weights:
        return elements + 4 * elements / QUANT_BLOCK
    return elements * bytes_per


def error_notes(c: CommCompression | None) -> list[str]:
    """What each active option does to the numbers, in words (the known bound)."""
    if c is None:
        return []
    notes = []
    if c.onebit:
        notes.append(f"{c.onebit}: the first {c.freeze_step:,} steps all-reduce at full size; afterwards 1 bit per "
                     f"element + one fp32 scale per chunk (~1/32 of fp32); per-step error <= the chunk's scale per "
                     f"element, fed back into the next step (error feedback), so it does not accumulate")
    if c.communication_data_type in ("fp16", "bf16"):
        rel = "2^-11" if c.communication_data_type == "fp16" else "2^-8"
        notes.append(f"communication_data_type {c.communication_data_type}: gradients reduced in 16 bits (half the "
                     f"bytes); each element rounded with relative error <= {rel}")
    if c.quantized_weights:
        notes.append(f"zero_quantized_weights: int8 parameter all-gathers + an fp32 scale per {QUANT_BLOCK} elements; "
                     f"max error scale/2 with scale = max|w|/127 of the block")
    if c.quantized_gradients:
        notes.append(f"zero_quantized_gradients: int4 gradient reduce-scatter (hierarchical all-to-alls) + scales; "
                     f"max error scale/2 per hop with scale = max|g|/7 of the block")
    if c.hpz_partition_size > 1:
        notes.append(f"zero_hpz_partition_size {c.hpz_partition_size}: a secondary parameter partition inside groups "
                     f"of {c.hpz_partition_size} ranks; backward gathers stay inside it (no numerical change)")
    if c.fp8_weights:
        notes.append("fp8.all_gather: the dense layers' weights all-gathered as float8 e4m3 (1 byte per element), "
                     "each with its whole weight's scale: the bytes torchao's tensorwise cast makes anyway "
                     "(no numerical change)")
    return notes
