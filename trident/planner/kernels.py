"""What the memory-bound work between GEMMs costs under the kernels that run it.

`Workload.kernels` names them:

- "eager": PyTorch ops one by one (a trident step without `compile`, torchtitan without
  `--compile`). RMSNorm is the composite op (torch <= 2.7 on CUDA: upcast to fp32, pow, mean,
  rsqrt, mul, cast back, mul by the weight; six kernels), SwiGLU is silu then mul, rotary is the
  complex-number product in fp32 (Llama's reference code and torchtitan's), attention is SDPA's
  flash backend (FlashAttention-2), the loss the fp32 log-softmax and nll (`LOSS_PASSES`).
- "compile": torch.compile of each block (trident's `compile` section, torchtitan's
  `--compile`): inductor fuses each chain of element-wise ops and reductions into one kernel
  that reads its inputs and writes its outputs once; SDPA's attention is kept as it is; the loss
  and head are outside the blocks, so they run eager.
- "fused": hand-fused kernels (Megatron-LM / Megatron Bridge with Transformer Engine): fused
  norms, SwiGLU, rotary, bias-dropout-add, cuDNN fused attention, fused cross-entropy.

Bytes are counted per element of the tensor an op works on, in (forward, backward), from the
passes each kernel makes over HBM (`e` = bytes of a 16-bit or 32-bit activation). One fused
kernel reads and writes once: (2e, 4e) for a norm or a one-input activation, backward reading
the input and output gradient and writing the input gradient (the planner's convention since
issue 35: backward twice the forward). Where eager runs several kernels, each pass is counted.
"""

from __future__ import annotations

from typing import Literal

Kernels = Literal["eager", "compile", "fused"]
KERNELS: tuple[str, ...] = ("eager", "compile", "fused")


def check_kernels(kernels: str) -> None:
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")


def norm_bytes(kernels: str, norm: str, e: int) -> tuple[float, float]:
    """(forward, backward) bytes per element of one norm over d_model.

    Eager RMSNorm, the composite op: upcast (read e, write 4), pow (read 4, write 4), mean (read
    4), mul by rsqrt (read 4, write 4), cast back (read 4, write e), mul by the weight (read e,
    write e): 28 + 4e. Its autograd backward reverses each: weight mul (read dy and x, write dx,
    read both again for the weight's gradient: 5e), cast (e + 4), mul (read dy and x twice, write
    dx: 12 + 4 for the rsqrt branch's reduction input), pow (read x and the broadcast gradient,
    write 4: 8), the two gradients summed (read 8, write 4: 12), upcast (4 + e): 48 + 7e.
    LayerNorm is one native kernel even in eager (`native_layer_norm`): the fused count."""
    if kernels == "eager" and norm == "rmsnorm":
        return 28 + 4 * e, 48 + 7 * e
    return 2 * e, 4 * e


def gated_activation_bytes(kernels: str, e: int) -> tuple[float, float]:
    """(forward, backward) bytes per element of d_ff of SwiGLU's silu(a) * b.

    Eager: silu (read a, write s: 2e), mul (read s and b, write y: 3e); backward: mul (read dy, s,
    b; write ds, db: 5e), silu (read ds and a, write da: 3e). Fused: read a and b, write y."""
    if kernels == "eager":
        return 5 * e, 8 * e
    return 3 * e, 6 * e


def rotary_bytes(kernels: str, e: int) -> tuple[float, float]:
    """(forward, backward) bytes per element of q and k of the rotary embedding.

    Eager (the fp32 complex product): upcast (read e, write 4), complex multiply by the
    frequencies (read 4, write 4; the [s, d/2] table is small), cast back (read 4, write e):
    16 + 2e; backward the same three in reverse. Fused: read e, write e."""
    if kernels == "eager":
        return 16 + 2 * e, 16 + 2 * e
    return 2 * e, 4 * e


def loss_bytes(kernels: str, e: int, eager_passes: tuple[float, float]) -> tuple[float, float]:
    """(forward, backward) bytes per logit of the cross-entropy loss.

    Eager and compile (the loss is outside the compiled blocks): `eager_passes`. Fused (Megatron's
    cross-entropy fusion, Transformer Engine's parallel cross-entropy): forward reads each logit
    once for the online max and sum and writes the gradient in place (2e); backward scales it
    (read e, write e)."""
    if kernels == "fused":
        return 2 * e, 2 * e
    return eager_passes


FLASH_ATTENTION_SHARE = {"sdpa": 0.35, "fused": 0.35 * 1.5}
"""Share of the 16-bit peak that fused attention reaches on Hopper (H100 / H200), forward and
backward. SDPA's flash backend is FlashAttention-2, which "achieves only 35% utilization on
H100" (Shah et al. 2024, FlashAttention-3, arXiv:2407.08608, abstract); the kernels Megatron
runs there (cuDNN fused attention, FlashAttention-3) are "1.5-2.0x faster" than it (same
abstract): the lower end is taken. Used where a GPU preset sets `GPUSpec.hopper_attention`;
a calibrated device's measured `attention_rates` win over both."""


def flash_share(kernels: str) -> float:
    """The share of peak of `FLASH_ATTENTION_SHARE` for the kernels that run attention."""
    return FLASH_ATTENTION_SHARE["fused" if kernels == "fused" else "sdpa"]


KERNELS_PER_LAYER = {"eager": (16, 24), "compile": (8, 12), "fused": (16, 24)}
"""(forward, backward) kernels of one layer besides its GEMMs. Eager and fused: the count the
planner has used since issue 35 (two norms, activation, two residual adds, head split/merge
copies, softmax or fused attention, dropouts, bias adds); compile: inductor's fused regions,
about half as many (norm, rotary, attention, residual + norm, activation, residual)."""


def rmsnorm_extra_kernels(kernels: str, norm: str) -> int:
    """Eager RMSNorm's extra kernels per layer, forward (two norms of six kernels, not one)."""
    return 2 * 5 if kernels == "eager" and norm == "rmsnorm" else 0
