"""Muon (Jordan et al., 2024; Moonlight, Liu et al., 2025) with AdamW for the parameters it
should not touch, as DeepSpeed's Muon and Moonlight run it.

Muon steps the hidden weight matrices; every other parameter (biases, norm gains, embeddings,
the output head: every non-matrix and the named exceptions) is stepped by AdamW with its own
lr and betas. Each param group carries `use_muon`; groups without it are split by each
tensor's own `use_muon` attribute (set by `flag_muon_params` from the module names, as
DeepSpeed's engine tags its parameters), else by shape (two or more dimensions: Muon).

Per Muon matrix W (n x m, higher-rank tensors viewed as n x prod(rest)), each step:

    B = momentum * B + G
    U = G + momentum * B   (nesterov)   or   U = B
    O = NS(U)              Newton-Schulz quintic: X = U / ||U||_F, transposed when n > m,
                           ns_steps times X = a X + (b A + c A A) X with A = X X^T,
                           (a, b, c) = (3.4445, -4.7750, 2.0315)
    W = W * (1 - lr * weight_decay) - lr * ratio * O
    ratio = sqrt(max(1, n / m))     (adjust_lr "spectral", the default: Keller Jordan's and
                                     DeepSpeed's scaling)
          = 0.2 * sqrt(max(n, m))   (adjust_lr "match_rms_adamw": Moonlight, the update's RMS
                                     matches AdamW's, so AdamW's lr and weight decay carry over)

The three phases (`momentum_update`, `orthogonalize`, `apply_update`) are separate functions
because only the middle one needs a matrix whole: the distributed step (trident.zero) runs
the first and last on shards and gathers U to one owner rank for the second. Newton-Schulz
runs in bf16 on a GPU (as Keller Jordan's, Moonlight's and DeepSpeed's Muon do: the
iteration is meant to tolerate it, and fp32 GEMMs run 15x slower on an H100) and in fp32 on a
CPU (where bf16 GEMMs are no faster and the tests compare with one process at 1e-5). A tensor-parallel slice
(`tp_spec`) is gathered whole over `tp_group`; every tp rank orthogonalizes the same matrix
and keeps its slice.
"""

from __future__ import annotations

import math
import re
from typing import Callable, Iterable, Literal

import torch
import torch.distributed as dist

from trident.comm import collectives
from trident.optim.lamb import run_closure

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
ADJUST_LR = ("match_rms_adamw", "spectral")
DEFAULT_EXCLUDE = (r"embed", r"(^|\.)(wte|wpe)(\.|$)", r"lm_head", r"(^|\.)(head|output)(\.|$)", r"norm",
                   r"(^|\.)ln(_\w+)?(\.|$)")
"""Module-name regexes whose matrices AdamW steps: embeddings, the output head, norms."""


def newton_schulz_dtype(device: torch.device) -> torch.dtype:
    """The dtype Newton-Schulz iterates in on `device`: bf16 on a GPU, fp32 elsewhere."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def newton_schulz(u: torch.Tensor, steps: int) -> torch.Tensor:
    """The orthogonalized matrix of `u` (2-D, or a batch of matrices along its leading
    dimensions) by `steps` quintic iterations, in `newton_schulz_dtype(u.device)`."""
    x = u.to(newton_schulz_dtype(u.device))
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + 1e-7)  # spectral norm <= Frobenius norm <= 1
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def lr_ratio(shape: tuple[int, ...], adjust_lr: str) -> float:
    """The factor Muon's lr is multiplied by for a matrix of this shape (n, m...)."""
    n, m = shape[0], math.prod(shape[1:])
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(n, m))
    return math.sqrt(max(1.0, n / m))


def momentum_update(grad: torch.Tensor, buf: torch.Tensor, momentum: float, nesterov: bool) -> torch.Tensor:
    """Update the momentum buffer in place; return U, the matrix to orthogonalize (elementwise:
    valid on any shard of the gradient and buffer)."""
    buf.mul_(momentum).add_(grad)
    return grad.add(buf, alpha=momentum) if nesterov else buf.clone()


def momentum_updates(grads: list[torch.Tensor], bufs: list[torch.Tensor], out: list[torch.Tensor], momentum: float,
                     nesterov: bool) -> None:
    """`momentum_update` over lists, U written into `out`: a few multi-tensor kernels for any
    number of pieces (the ZeRO step's shards), the same arithmetic element for element."""
    torch._foreach_mul_(bufs, momentum)
    torch._foreach_add_(bufs, grads)
    torch._foreach_copy_(out, grads if nesterov else bufs)
    if nesterov:
        torch._foreach_add_(out, bufs, alpha=momentum)


def orthogonalize(u: torch.Tensor, shape: tuple[int, ...], group: dict, stacked: bool = False) -> torch.Tensor:
    """NS(U) times the lr ratio, for a whole tensor of `shape` (its elements in any layout): one
    matrix of shape[0] rows, or with `stacked` (experts stacked in one 3-D tensor) one matrix
    per entry of the first dimension."""
    if stacked:
        matrices = u.reshape(shape)
        ratio = lr_ratio(tuple(shape[1:]), group["adjust_lr"])
        return newton_schulz(matrices, group["ns_steps"]).mul_(ratio).reshape(u.shape)
    matrix = u.reshape(shape[0], -1)
    return newton_schulz(matrix, group["ns_steps"]).mul_(lr_ratio(shape, group["adjust_lr"])).reshape(u.shape)


def is_stacked(p: torch.Tensor) -> bool:
    """Whether `p` holds a matrix per expert along its first dimension (`flag_muon_params`)."""
    return bool(getattr(p, "muon_stacked", False))


def apply_update(p: torch.Tensor, update: torch.Tensor, group: dict) -> None:
    """Decoupled weight decay, then the step (elementwise: valid on shards)."""
    p.mul_(1 - group["lr"] * group["weight_decay"]).add_(update.to(p.dtype), alpha=-group["lr"])


def apply_updates(params: list[torch.Tensor], updates: list[torch.Tensor], group: dict) -> None:
    """`apply_update` over lists of fp32 shards, as two multi-tensor kernels."""
    torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
    torch._foreach_add_(params, updates, alpha=-group["lr"])


def adamw_update(p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
    """One AdamW step of a non-Muon parameter (elementwise), torch.optim.AdamW's arithmetic."""
    if not state:
        state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
    beta1, beta2 = group["betas"]
    state["step"] += 1
    t = state["step"]
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m.lerp_(grad, 1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (v / (1 - beta2 ** t)).sqrt_().add_(group["eps"])
    p.mul_(1 - group["lr"] * group["weight_decay"]).addcdiv_(m, denom, value=-group["lr"] / (1 - beta1 ** t))


class Muon(torch.optim.Optimizer):
    """Muon for the hidden matrices, AdamW (`adam_*`) for the rest; see the module docstring.
    `adam_lr` / `adam_weight_decay` None: Muon's lr / weight_decay. Defaults are DeepSpeed's
    MuonWithAuxAdam's (lr 0.02, spectral scaling, AdamW eps 1e-10)."""

    def __init__(self, params: Iterable, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, weight_decay: float = 0.0,
                 adjust_lr: Literal["match_rms_adamw", "spectral"] = "spectral",
                 adam_lr: float | None = None, adam_betas: tuple[float, float] = (0.9, 0.95),
                 adam_eps: float = 1e-10, adam_weight_decay: float | None = None) -> None:
        if adjust_lr not in ADJUST_LR:
            raise ValueError(f"Muon adjust_lr must be one of {', '.join(ADJUST_LR)}, got {adjust_lr!r}")
        if lr < 0 or not 0 <= momentum < 1 or ns_steps < 1 or weight_decay < 0:
            raise ValueError(f"Muon needs lr >= 0, momentum in [0, 1), ns_steps >= 1 and weight_decay >= 0; got "
                             f"lr={lr}, momentum={momentum}, ns_steps={ns_steps}, weight_decay={weight_decay}")
        self.adam_defaults = dict(lr=lr if adam_lr is None else adam_lr, betas=tuple(adam_betas), eps=adam_eps,
                                  weight_decay=weight_decay if adam_weight_decay is None else adam_weight_decay)
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        weight_decay=weight_decay, adjust_lr=adjust_lr)
        super().__init__(self._split(params), defaults)
        self.tp_group = None  # the tensor-parallel group, set by the engine when tp > 1

    def _split(self, params: Iterable) -> list[dict]:
        params = list(params)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        out = []
        for group in groups:
            tensors = [group["params"]] if isinstance(group["params"], torch.Tensor) else list(group["params"])
            if "use_muon" in group:
                out.append(self._with_adam_defaults(dict(group, params=tensors)))
                continue
            for flag in (True, False):
                mine = [p for p in tensors if uses_muon(p) == flag]
                if mine:
                    out.append(self._with_adam_defaults(dict(group, params=mine, use_muon=flag)))
        return out

    def _with_adam_defaults(self, group: dict) -> dict:
        if not group["use_muon"]:
            for key, value in self.adam_defaults.items():
                group.setdefault(key, value)
        return group

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = run_closure(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not group["use_muon"]:
                    adamw_update(p, p.grad, self.state[p], group)
                    continue
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                u = momentum_update(p.grad, state["momentum_buffer"], group["momentum"], group["nesterov"])
                spec = tp_spec(p)
                if spec is None:
                    apply_update(p, orthogonalize(u, tuple(p.shape), group, is_stacked(p)), group)
                    continue
                apply_update(p, orthogonalize_tp_slice(u, spec, self.tp_group, group, is_stacked(p)), group)
        return loss


def orthogonalize_tp_slice(u: torch.Tensor, spec, tp_group, group: dict, stacked: bool = False) -> torch.Tensor:
    """This rank's slice of the orthogonalized whole matrix, from every tensor-parallel rank's
    slice `u` (a collective over `tp_group`: each tp rank runs Newton-Schulz on the same whole
    matrix and keeps its own slice)."""
    if tp_group is None:
        raise ValueError("Muon got a tensor-parallel slice but no tp group: set optimizer.tp_group (the "
                         "engine does) so each matrix can be gathered whole")
    shards = [torch.empty_like(u) for _ in range(spec.tp_size)]
    collectives.all_gather_list(shards, u.contiguous(), group=tp_group)
    whole = spec.merge(shards)
    return spec.shard(orthogonalize(whole, tuple(whole.shape), group, stacked), dist.get_rank(tp_group))


def tp_spec(p: torch.Tensor):
    """The tensor-parallel split of `p` (trident.tensor_parallel's `tp_spec`), None when whole."""
    spec = getattr(p, "tp_spec", None)
    return spec if spec is not None and getattr(p, "tensor_model_parallel", False) and spec.tp_size > 1 else None


def uses_muon(p: torch.Tensor) -> bool:
    """The tensor's `use_muon` flag if set, else whether it is a matrix (two or more dimensions)."""
    flag = getattr(p, "use_muon", None)
    return _ndim(p) >= 2 if flag is None else bool(flag)


def _ndim(p: torch.Tensor) -> int:
    """Dimensions of the parameter as its layer has it (zero.Init leaves a flat placeholder)."""
    return len(getattr(p, "_trident_shape", p.shape))


STACKED_EXPERTS = re.compile(r"(^|\.)experts\.[^.]+$")
"""A parameter held directly by an `experts` module: `transformers` MoE layers stack their
experts' matrices in one 3-D tensor (Mixtral's `experts.gate_up_proj`: experts x 2 ff x d)."""


def flag_muon_params(model: torch.nn.Module, exclude: Iterable[str] = DEFAULT_EXCLUDE) -> dict[str, bool]:
    """Set `use_muon` on every parameter of `model`: a matrix whose name matches none of the
    `exclude` regexes; and `muon_stacked` on the 3-D ones an `experts` module holds (a matrix
    per expert, each orthogonalized alone). Returns name -> flag (what the start-up log reports)."""
    patterns = [re.compile(e) for e in exclude]
    flags = {}
    for name, p in model.named_parameters():
        p.use_muon = _ndim(p) >= 2 and not any(rx.search(name) for rx in patterns)
        p.muon_stacked = p.use_muon and _ndim(p) == 3 and bool(STACKED_EXPERTS.search(name))
        flags[name] = p.use_muon
    return flags
