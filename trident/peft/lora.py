"""LoRA: a frozen linear layer plus a trainable low-rank update, y = W x + (alpha / r) B A x.

`apply_lora(model, r=..., target_modules=[...])` replaces each targeted linear layer by a
`LoRALinear` that keeps the original layer (its weights frozen) as `base` and adds `lora_A`
(r x in) and `lora_B` (out x r). B starts at zero, so the wrapped model computes exactly what
the base model did until the first step. The parallel machinery needs nothing special: frozen
weights get no gradient, no optimizer state and no traffic under every strategy.

Tensor parallelism: the adapter is split the way its base layer is, so that its output adds to
the base layer's local output, and the result equals LoRA on the unsplit layer.

    column-split base (output features split):  A replicated, B split by output rows.
        forward: h = A x on every rank; the gradient of h is summed over tp in backward
        (`copy_to_tp_region`: identity forward, all-reduce backward), because each rank's
        B slice contributes only its part of dL/dh.
    row-split base (input features split):       A split by input columns, B replicated.
        forward: h = sum over tp of A_local x_local (`reduce_from_tp_region`: all-reduce
        forward, identity backward), then B h, added after the base layer's own sum.

With sequence parallelism the base layers trade sequence shards for whole sequences; the
adapter follows them. Column: h = A x on the gathered sequence, each rank's dL/dA is partial
(its B slice), so A's gradient is summed over tp. Row: the partial A x is reduce-scattered to
this rank's sequence shard, so B sees a shard and its gradient is summed over tp.

Weights are initialised whole from the seed and then sliced, so a tp run starts from the
serial run's adapters. `init="gaussian"` draws A from N(0, 1/r); `init="pissa"` puts the base
weight's top-r singular directions into A and B (scaled by the square root of the singular values
over the scaling) and removes them from the frozen weight, so the sum is unchanged.
"""

from __future__ import annotations

import math
import re
import zlib
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from trident.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, mark_sequence_parallel,
                                            set_tp_attributes)
from trident.tensor_parallel.mappings import (SEQUENCE_DIM, copy_to_tp_region, gather_from_sequence_parallel_region,
                                              reduce_from_tp_region, reduce_scatter_to_sequence_parallel_region)

INITS = ("default", "gaussian", "pissa")
BIASES = ("none", "lora_only", "all")


class LoRALinear(nn.Module):
    """`base` (frozen) plus the low-rank update; `base` is an nn.Linear or a trident tp linear."""

    def __init__(self, base: nn.Module, r: int, alpha: float, dropout: float = 0.0, init: str = "default",
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.base, self.r, self.alpha = base, r, alpha
        self.scaling = alpha / r
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.split = ("column" if isinstance(base, ColumnParallelLinear)
                      else "row" if isinstance(base, RowParallelLinear) else None)
        in_f, out_f = base.in_features, base.out_features
        full_a, full_b = self._initial(base, in_f, out_f, init, generator)
        weight_dtype = base.weight.dtype
        if self.split == "column":
            spec = base.spec  # B's rows follow the base weight's rows (stride and padding included)
            self.lora_A = nn.Parameter(full_a.to(weight_dtype))
            self.lora_B = nn.Parameter(spec.shard(full_b, base.tp_rank).to(weight_dtype))
            set_tp_attributes(self.lora_B, spec)
            if base.sequence_parallel:
                mark_sequence_parallel(self.lora_A, base, base.logger)
        elif self.split == "row":
            spec = base.spec  # A's columns follow the base weight's columns
            self.lora_A = nn.Parameter(spec.shard(full_a, base.tp_rank).to(weight_dtype))
            set_tp_attributes(self.lora_A, spec)
            self.lora_B = nn.Parameter(full_b.to(weight_dtype))
            if base.sequence_parallel:
                mark_sequence_parallel(self.lora_B, base, base.logger)
        else:
            self.lora_A = nn.Parameter(full_a.to(weight_dtype))
            self.lora_B = nn.Parameter(full_b.to(weight_dtype))

    def _initial(self, base: nn.Module, in_f: int, out_f: int, init: str,
                 generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole A (r x in) and B (out x r), from the seed (or the whole base weight for PiSSA),
        drawn on the CPU so that every device and layout draws the same numbers."""
        a = torch.empty(self.r, in_f, dtype=torch.float32)
        b = torch.zeros(out_f, self.r, dtype=torch.float32)
        if init == "default":
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)  # as nn.Linear does
        elif init == "gaussian":
            nn.init.normal_(a, std=1.0 / self.r, generator=generator)
        elif init == "pissa":
            if self.split is not None:
                raise ValueError("lora.init 'pissa' needs the whole base weight: apply LoRA before tensor "
                                 "parallelism splits the layer, or use init 'default' or 'gaussian'")
            with torch.no_grad():
                w = base.weight.detach().float()
                u, s, vh = torch.linalg.svd(w, full_matrices=False)
                root = (s[:self.r] / self.scaling).sqrt()
                a = root[:, None] * vh[:self.r]
                b = u[:, :self.r] * root[None, :]
                base.weight.sub_((self.scaling * b @ a).to(base.weight.dtype))
        else:
            raise ValueError(f"lora.init {init!r}: expected one of {', '.join(INITS)}")
        return a.to(base.weight.device), b.to(base.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        x = self.dropout(x)
        base = self.base
        if self.split == "column" and base.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, base.tp_group, base.logger, SEQUENCE_DIM)
            h = F.linear(x, self.lora_A)  # dL/dh is partial here: A's gradient is summed over tp
        elif self.split == "column":
            h = copy_to_tp_region(F.linear(x, self.lora_A), base.tp_group, base.logger)
        elif self.split == "row":
            if not base.input_is_parallel:
                raise ValueError("LoRA on a RowParallelLinear with input_is_parallel=False is not supported")
            partial = F.linear(x, self.lora_A)
            h = (reduce_scatter_to_sequence_parallel_region(partial, base.tp_group, base.logger, SEQUENCE_DIM)
                 if base.sequence_parallel else reduce_from_tp_region(partial, base.tp_group, base.logger))
        else:
            h = F.linear(x, self.lora_A)
        return y + self.scaling * F.linear(h, self.lora_B)

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """scaling x B A: what merging adds to this rank's (local) base weight."""
        return (self.scaling * self.lora_B.float() @ self.lora_A.float()).to(self.base.weight.dtype)

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha}, split={self.split or 'none'}"


def _matches(name: str, patterns: Iterable[str]) -> bool:
    """peft's rule: a pattern matches a module whose name equals it or ends with '.' + it; a
    pattern with regex characters must match the whole name."""
    for p in patterns:
        if any(c in p for c in "*+?[]()|^$\\"):
            if re.fullmatch(p, name):
                return True
        elif name == p or name.endswith("." + p):
            return True
    return False


def apply_lora(model: nn.Module, r: int = 8, alpha: float = 16.0, dropout: float = 0.0,
               target_modules: Iterable[str] = ("qkv", "proj", "fc"), modules_to_save: Iterable[str] = (),
               bias: str = "none", init: str = "default", seed: int | None = None) -> nn.Module:
    """Freeze `model` and wrap its `target_modules` linear layers with LoRA adapters (in place).

    `modules_to_save` stay fully trainable (e.g. a classification head); `bias` chooses which
    biases train: "none", "lora_only" (those of the wrapped layers) or "all". With `seed`, each
    adapter draws from its own generator seeded by (seed, module name), so every layout (and a
    pipeline stage holding only some of the layers) draws what one process draws; without it,
    from torch's default generator. Returns the model.
    """
    target_modules, modules_to_save = list(target_modules), list(modules_to_save)
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise ValueError(f"lora.r must be a positive integer, got {r!r}")
    if bias not in BIASES:
        raise ValueError(f"lora.bias {bias!r}: expected one of {', '.join(BIASES)}")
    if init not in INITS:
        raise ValueError(f"lora.init {init!r}: expected one of {', '.join(INITS)}")
    if not target_modules:
        raise ValueError("lora.target_modules is empty: name the linear layers to adapt, e.g. [\"qkv\", \"proj\"]")
    targets = [(n, m) for n, m in model.named_modules() if n and _matches(n, target_modules)]
    unused = [p for p in target_modules if not any(_matches(n, [p]) for n, _ in targets)]
    if unused:
        raise ValueError(f"lora.target_modules: {unused} match no module of the model; module names look like "
                         f"{[n for n, _ in list(model.named_modules())[1:6]]}")
    wrong = [(n, type(m).__name__) for n, m in targets
             if not isinstance(m, (nn.Linear, ColumnParallelLinear, RowParallelLinear))]
    if wrong:
        raise ValueError(f"lora.target_modules: LoRA wraps linear layers (nn.Linear, ColumnParallelLinear, "
                         f"RowParallelLinear); {wrong[0][0]!r} is a {wrong[0][1]}. Narrow the pattern")
    if dropout > 0 and any(getattr(m, "sequence_parallel", False) for _, m in targets):
        raise ValueError(f"lora.dropout = {dropout} with tensor_parallel.sequence_parallel: the adapter's input "
                         "dropout would draw per sequence shard; set lora.dropout to 0 or turn sequence "
                         "parallelism off")
    for p in model.parameters():
        p.requires_grad_(False)
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        generator = None
        if seed is not None:
            generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
        wrapped = LoRALinear(module, r, alpha, dropout, init, generator)
        if bias == "lora_only" and getattr(module, "bias", None) is not None:
            module.bias.requires_grad_(True)
        setattr(parent, child, wrapped)
    if bias == "all":
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.requires_grad_(True)
    for name, module in model.named_modules():
        if name and modules_to_save and _matches(name, modules_to_save):
            for p in module.parameters():
                p.requires_grad_(True)
    return model


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors (and trainable non-adapter ones) of `model`, by state-dict name."""
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    return {k: v for k, v in model.state_dict(keep_vars=True).items()
            if "lora_" in k or id(v) in trainable}


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and put the base layer back in its place."""
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            module.base.weight.add_(module.delta_weight())
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, module.base)
    return model
