"""Optimizers from a config's `optimizer` section, with DeepSpeed's names and meanings.

Types are case-insensitive, as in DeepSpeed: Adam, AdamW, SGD, Adagrad, Lion, Lamb, and the 1-bit
optimizers OneBitAdam, ZeroOneAdam and OneBitLamb (trident.optim.onebit_adam, .zero_one_adam,
.onebit_lamb: they communicate themselves, through trident.compression), and Muon
(trident.optim.muon: AdamW inside for the non-matrices). Two DeepSpeed facts
worth knowing:

* `Adam` means Adam with *decoupled* weight decay (AdamW) unless `adam_w_mode` is false, because
  DeepSpeed's FusedAdam defaults to `adam_w_mode=True`. `AdamW` is always decoupled.
* Unset `weight_decay` is 0 (FusedAdam's default); with `torch_adam: true` DeepSpeed hands the
  params to torch.optim instead, so an unset weight_decay is torch's own (0.01 for AdamW).

trident always runs torch.optim's implementations: fused kernels when every parameter is on one
kind of device (GPU, or CPU: torch's fused CPU kernels are 5-7x faster than its foreach path there,
bench/cpu_optimizer.py), the multi-tensor (foreach) path otherwise. Under ZeRO-Offload
(`zero_optimization.offload_optimizer.device` cpu or nvme) Adam / AdamW are built as
trident.optim.cpu_adam.CPUAdam, with DeepSpeedCPUAdam's signature. Lion has no torch.optim version; `Lion` below is
its short reference form.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Iterable, Literal

import torch

from pydantic import AfterValidator, Field, field_validator, model_validator

from trident.config.errors import ConfigError, ConfigIssue, describe_value, rule_error, unknown_name_message
from trident.config.loader import register_section_rules, validate_section
from trident.config.schema import OptimizerConfig, Section
from trident.optim.compressed import COMM_BACKENDS
from trident.optim.lamb import Lamb, run_closure
from trident.optim.muon import ADJUST_LR, DEFAULT_EXCLUDE, Muon
from trident.optim.onebit_adam import OneBitAdam
from trident.optim.onebit_lamb import OneBitLamb
from trident.optim.zero_one_adam import ZeroOneAdam


def _check_betas(value: Any) -> tuple[float, float]:
    numbers = isinstance(value, (list, tuple)) and len(value) == 2 and all(
        isinstance(b, (int, float)) and not isinstance(b, bool) for b in value)
    if not numbers or not all(0 <= b < 1 for b in value):
        raise rule_error(f"expected two numbers [beta1, beta2], each in [0, 1), got {describe_value(value)}; "
                         "for example [0.9, 0.999]")
    return float(value[0]), float(value[1])


Betas = Annotated[Any, AfterValidator(_check_betas)]


class AdamParams(Section):
    """`params` of Adam and AdamW (DeepSpeed's FusedAdam names)."""

    lr: float = Field(1e-3, ge=0, description="Learning rate (0 is allowed: a scheduler may set it).")
    betas: Betas = Field((0.9, 0.999), description="Decay rates of the first and second moment averages.")
    eps: float = Field(1e-8, ge=0, description="Added to the denominator for numerical stability.")
    weight_decay: float | None = Field(None, ge=0, description=(
        "Weight decay; null = 0, or torch's default (0.01 for AdamW) when torch_adam is true."))
    bias_correction: bool = Field(True, description="Correct the moment averages' bias toward zero early on.")
    amsgrad: bool = Field(False, description="Use the maximum of past second moments (AMSGrad).")
    adam_w_mode: bool = Field(True, description=(
        "Decoupled weight decay (AdamW) for type Adam; false = L2 penalty in the gradient."))
    torch_adam: bool = Field(False, description="DeepSpeed: use torch.optim's Adam instead of its fused kernel.")

    @field_validator("bias_correction")
    @classmethod
    def _always_corrected(cls, value: bool) -> bool:
        if not value:
            raise rule_error("false is not supported: trident runs torch.optim.Adam/AdamW, which always correct "
                             "the bias; remove bias_correction or set it to true")
        return value


class SGDParams(Section):
    """`params` of SGD (torch.optim.SGD's names, which DeepSpeed passes through)."""

    lr: float = Field(1e-3, ge=0, description="Learning rate (0 is allowed: a scheduler may set it).")
    momentum: float = Field(0.0, ge=0, description="Momentum factor; 0 = plain SGD.")
    dampening: float = Field(0.0, ge=0, description="Dampening of the momentum's gradient term.")
    weight_decay: float = Field(0.0, ge=0, description="L2 penalty added to the gradient.")
    nesterov: bool = Field(False, description="Nesterov momentum (needs momentum > 0 and dampening 0).")

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> SGDParams:
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ConfigError([ConfigIssue("nesterov", (
                f"true needs momentum > 0 and dampening 0, got momentum {self.momentum} and dampening "
                f"{self.dampening}; set a momentum (e.g. 0.9) or set nesterov to false"))])
        return self


class AdagradParams(Section):
    """`params` of Adagrad (torch.optim.Adagrad's names)."""

    lr: float = Field(1e-2, ge=0, description="Learning rate (0 is allowed: a scheduler may set it).")
    lr_decay: float = Field(0.0, ge=0, description="lr / (1 + (step - 1) * lr_decay).")
    weight_decay: float = Field(0.0, ge=0, description="L2 penalty added to the gradient.")
    initial_accumulator_value: float = Field(0.0, ge=0, description="Start value of the squared-gradient sums.")
    eps: float = Field(1e-10, ge=0, description="Added to the denominator for numerical stability.")


class LionParams(Section):
    """`params` of Lion (DeepSpeed's FusedLion names and defaults)."""

    lr: float = Field(1e-3, ge=0, description="Learning rate (Lion's sign update wants a smaller lr than Adam).")
    betas: Betas = Field((0.9, 0.999), description="beta1 interpolates the update, beta2 decays the momentum.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay: p -= lr * weight_decay * p.")


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"). Per step:

        update = sign(beta1 * m + (1 - beta1) * g)
        p      = p * (1 - lr * weight_decay) - lr * update
        m      = beta2 * m + (1 - beta2) * g
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0) -> None:
        if lr <= 0 or not all(0 <= b < 1 for b in betas) or weight_decay < 0:
            raise ValueError(f"Lion needs lr > 0, betas in [0, 1) and weight_decay >= 0; got lr={lr}, "
                             f"betas={betas}, weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = run_closure(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                m = state["exp_avg"]
                update = torch.lerp(p.grad, m, beta1).sign_()
                p.mul_(1 - lr * wd).add_(update, alpha=-lr)
                m.lerp_(p.grad, 1 - beta2)
        return loss


def _no_amsgrad(value: bool) -> bool:
    if value:
        raise rule_error("true is not supported: DeepSpeed's Lamb and 1-bit optimizers have no AMSGrad variant; "
                         "remove amsgrad or set it to false")
    return value


NoAmsgrad = Annotated[bool, AfterValidator(_no_amsgrad)]


class _LambLike(Section):
    """The `params` DeepSpeed's FusedLamb and its 1-bit optimizers share."""

    lr: float = Field(1e-3, ge=0, description="Learning rate (0 is allowed: a scheduler may set it).")
    bias_correction: bool = Field(True, description=(
        "Lamb: fold Adam's bias correction into the step size. The 1-bit optimizers accept it and, as in "
        "DeepSpeed, never correct the bias."))
    betas: Betas = Field((0.9, 0.999), description="Decay rates of the first and second moment averages.")
    eps: float = Field(1e-8, ge=0, description="Added to the denominator for numerical stability.")
    eps_inside_sqrt: bool = Field(False, description=(
        "Lamb: sqrt(v + eps) instead of sqrt(v) + eps. Accepted by the 1-bit optimizers without effect (DeepSpeed)."))
    weight_decay: float = Field(0.0, ge=0, description="Weight decay, added to the update (times lr).")
    amsgrad: NoAmsgrad = Field(False, description="Not supported (DeepSpeed neither); must be false.")


class _CoeffBounds(Section):
    max_coeff: float = Field(10.0, gt=0, description="Upper bound of the LAMB trust ratio ||p|| / ||update||.")
    min_coeff: float = Field(0.01, ge=0, description="Lower bound of the LAMB trust ratio.")

    @model_validator(mode="after")
    def _ordered(self):
        if self.min_coeff > self.max_coeff:
            raise ConfigError([ConfigIssue("min_coeff", (
                f"{self.min_coeff} is above max_coeff {self.max_coeff}; the trust ratio is clamped to "
                "[min_coeff, max_coeff], so min_coeff must not exceed max_coeff"))])
        return self


class LambParams(_LambLike, _CoeffBounds):
    """`params` of Lamb (DeepSpeed's FusedLamb names and defaults)."""


class _OneBitCommon(_LambLike):
    cuda_aware: bool = Field(False, description=(
        "DeepSpeed: the MPI library is CUDA-aware. Accepted; trident compresses over the dp group's own backend."))
    comm_backend_name: Literal[COMM_BACKENDS] = Field("nccl", description=(
        "DeepSpeed's transport for the compressed all-reduce (nccl, mpi, hccl, compressed); trident accepts "
        "these and gloo, and uses the data-parallel process group's backend whichever is named."))


_FREEZE = "Uncompressed warm-up steps (dp-averaged gradients, variance updated) before 1-bit compression starts."


class OneBitAdamParams(_OneBitCommon):
    """`params` of OneBitAdam (DeepSpeed's names and defaults)."""

    freeze_step: int = Field(100000, ge=0, description=_FREEZE)


class ZeroOneAdamParams(_OneBitCommon):
    """`params` of ZeroOneAdam (DeepSpeed's names and defaults)."""

    var_freeze_step: int = Field(100000, ge=0, description=(
        "The last step that updates the variance; local steps with 1-bit syncs follow it."))
    var_update_scaler: int = Field(16, ge=1, description=(
        "Variance updates between doublings of the interval between them (kappa in the 0/1 Adam paper)."))
    local_step_scaler: int = Field(32678, ge=1, description=(
        "Steps between doublings of the local-step interval (after var_freeze_step)."))
    local_step_clipper: int = Field(16, ge=1, description="Largest local-step interval (H in the paper).")


class OneBitLambParams(_OneBitCommon, _CoeffBounds):
    """`params` of OneBitLamb (DeepSpeed's names and defaults)."""

    freeze_step: int = Field(100000, ge=0, description=_FREEZE)
    coeff_beta: float = Field(0.9, ge=0, lt=1, description=(
        "Decay of the running average of the trust ratio that is frozen at freeze_step."))
    factor_max: float = Field(4.0, gt=0, description="Upper bound of the factor applied to the frozen trust ratio.")
    factor_min: float = Field(0.5, gt=0, description="Lower bound of that factor.")
    factor_threshold: float = Field(0.1, ge=0, description="Largest relative change of the factor from one step to the next.")


def _check_regexes(value: Any) -> list[str]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise rule_error(f"expected a list of regular expressions (strings), got {describe_value(value)}")
    for v in value:
        try:
            re.compile(v)
        except re.error as e:
            raise rule_error(f"{v!r} is not a valid regular expression ({e})") from None
    return list(value)


class MuonParams(Section):
    """`params` of Muon (trident.optim.muon): Muon for hidden matrices, AdamW (`adam_*`) for the rest.

    Defaults and spellings are DeepSpeed's (its MuonWithAuxAdam, Keller Jordan's Muon): `lr` is
    both groups' rate (Muon 0.02 and AdamW 3e-4 when unset), `muon_lr` / `adam_lr` override it
    for one group, `betas` / `eps` are AdamW's (also spelled `adam_betas` / `adam_eps`), and the
    matrices' update is scaled by sqrt(max(1, n / m)) (`adjust_lr: "spectral"`)."""

    lr: float = Field(0.02, ge=0, description=(
        "Muon's learning rate (scaled per matrix by adjust_lr), and AdamW's unless adam_lr is set; `muon_lr` "
        "(DeepSpeed's spelling) sets Muon's alone."))
    momentum: float = Field(0.95, ge=0, lt=1, description="Momentum of the matrices' gradient average.")
    nesterov: bool = Field(True, description="Orthogonalize g + momentum * buffer instead of the buffer.")
    ns_steps: int = Field(5, ge=1, description="Newton-Schulz iterations per orthogonalization.")
    ns_method: Literal["gram", "standard"] = Field("gram", description=(
        "DeepSpeed's choice of iteration; Gram Newton-Schulz and the standard quintic compute the same "
        "orthogonalization, and trident runs the standard quintic for both."))
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay of the Muon matrices.")
    adjust_lr: Literal[ADJUST_LR] = Field("spectral", description=(
        "Per-matrix lr factor: spectral = sqrt(max(1, n / m)) (Keller Jordan's and DeepSpeed's), "
        "match_rms_adamw = 0.2 * sqrt(max(n, m)) (Moonlight: the update's RMS matches AdamW's, so AdamW's lr "
        "and weight decay carry over)."))
    adam_lr: float | None = Field(None, ge=0, description="AdamW's lr for the other parameters; null = lr, or "
                                                          "3e-4 when lr is unset (DeepSpeed's default).")
    adam_betas: Betas = Field((0.9, 0.95), description="AdamW's betas for the other parameters (also `betas`).")
    adam_eps: float = Field(1e-10, ge=0, description="AdamW's eps for the other parameters (also `eps`).")
    adam_weight_decay: float | None = Field(None, ge=0, description="AdamW's weight decay; null = weight_decay.")
    exclude: Annotated[Any, AfterValidator(_check_regexes)] = Field(list(DEFAULT_EXCLUDE), description=(
        "Parameter-name regexes whose matrices AdamW steps instead (embeddings, the head, norms by default); "
        "every non-matrix is AdamW's anyway."))


AUX_ADAM_LR = 3e-4
"""AdamW's lr inside Muon when the config sets none (DeepSpeed's MuonWithAuxAdam default)."""


def _muon_spellings(params: dict) -> tuple[dict, list[ConfigIssue]]:
    """DeepSpeed's Muon keys read into trident's: `betas` / `eps` are AdamW's, `muon_lr`
    overrides `lr` for the matrices (`lr` then stays AdamW's), an unset AdamW lr is `lr`, or
    DeepSpeed's 3e-4 when `lr` is unset too."""
    issues = []
    for theirs, ours in (("betas", "adam_betas"), ("eps", "adam_eps")):
        if theirs in params:
            if ours in params:
                issues.append(ConfigIssue(f"optimizer.params.{theirs}", (
                    f"set together with {ours}; both name AdamW's {theirs} inside Muon: keep one")))
            params[ours] = params.pop(theirs)
    if params.pop("per_head_muon", False) is not False:
        issues.append(ConfigIssue("optimizer.params.per_head_muon", (
            "true is not supported: trident orthogonalizes each attention projection whole (DeepSpeed's "
            "per-head Muon splits it by heads); set per_head_muon to false or remove it")))
    lr = params.get("lr")
    if "muon_lr" in params:
        params["lr"] = params.pop("muon_lr")
    if params.get("adam_lr") is None:
        params["adam_lr"] = lr if lr is not None else AUX_ADAM_LR
    return params, issues


@dataclass(frozen=True)
class _Kind:
    name: str
    params: type[Section]
    build: Callable[[list, Any, dict], torch.optim.Optimizer]


def _adam(decoupled_always: bool) -> Callable:
    def build(params: list, p: AdamParams, impl: dict) -> torch.optim.Optimizer:
        decoupled = decoupled_always or p.adam_w_mode
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        return cls(params, lr=p.lr, betas=p.betas, eps=p.eps, amsgrad=p.amsgrad,
                   weight_decay=_adam_weight_decay(p, decoupled), **impl)
    return build


def _adam_weight_decay(p: AdamParams, decoupled: bool) -> float:
    if p.weight_decay is not None:
        return p.weight_decay
    return 0.01 if p.torch_adam and decoupled else 0.0


OPTIMIZERS: dict[str, _Kind] = {k.name.lower(): k for k in (
    _Kind("Adam", AdamParams, _adam(decoupled_always=False)),
    _Kind("AdamW", AdamParams, _adam(decoupled_always=True)),
    _Kind("SGD", SGDParams, lambda params, p, impl: torch.optim.SGD(params, **p.model_dump(), **impl)),
    _Kind("Adagrad", AdagradParams, lambda params, p, impl: torch.optim.Adagrad(params, **p.model_dump(), **impl)),
    _Kind("Lion", LionParams, lambda params, p, impl: Lion(params, **p.model_dump())),
    _Kind("Lamb", LambParams, lambda params, p, impl: Lamb(params, **p.model_dump())),
    _Kind("OneBitAdam", OneBitAdamParams, lambda params, p, impl: OneBitAdam(params, **p.model_dump())),
    _Kind("ZeroOneAdam", ZeroOneAdamParams, lambda params, p, impl: ZeroOneAdam(params, **p.model_dump())),
    _Kind("OneBitLamb", OneBitLambParams, lambda params, p, impl: OneBitLamb(params, **p.model_dump())),
    _Kind("Muon", MuonParams,
          lambda params, p, impl: Muon(params, **p.model_dump(exclude={"exclude", "ns_method"}))),
)}
"""Lower-case type name -> how to check its params and build it."""

_DEEPSPEED_ONLY = ("MuAdam", "MuAdamW", "MuSGD")


def check_optimizer(type: str, params: dict) -> list[ConfigIssue]:
    """Every problem with an optimizer's type and params, at JSON paths under `optimizer.`."""
    return _validate(type, params)[2]


def resolve_optimizer_config(cfg: OptimizerConfig) -> OptimizerConfig:
    """The section with its canonical type name and every param filled in (what will run)."""
    kind, p, issues = _validate(cfg.type, cfg.params)
    if issues:
        raise ConfigError(issues)
    params = p.model_dump(mode="json")
    if isinstance(p, AdamParams):
        params["weight_decay"] = _adam_weight_decay(p, kind.name == "AdamW" or p.adam_w_mode)
    return OptimizerConfig(type=kind.name, params=params)


register_section_rules("optimizer", check_optimizer, resolve_optimizer_config)


def build_optimizer(cfg: OptimizerConfig | None, params: Iterable, offload: bool = False) -> torch.optim.Optimizer:
    """Build the optimizer a config section describes over `params` (tensors or param groups);
    `offload`: the step runs on the CPU (ZeRO-Offload), Adam-family types become CPUAdam."""
    if cfg is None:
        raise ConfigError([ConfigIssue("optimizer", (
            "no optimizer: pass optimizer= to trident.initialize, or add an `optimizer` section to the "
            'config, e.g. {"type": "AdamW", "params": {"lr": 0.001}}'))])
    kind, p, issues = _validate(cfg.type, cfg.params)
    if issues:
        raise ConfigError(issues)
    params = [dict(g, params=_as_list(g["params"])) if isinstance(g, dict) else g for g in params]
    if offload and kind.name in ("Adam", "AdamW"):
        return _cpu_adam(kind.name, params, p)
    return kind.build(params, p, _implementation(params))


def _cpu_adam(name: str, params: list, p: AdamParams) -> torch.optim.Optimizer:
    from trident.monitor.log import logger
    from trident.optim.cpu_adam import CPUAdam
    decoupled = name == "AdamW" or p.adam_w_mode
    opt = CPUAdam(params, lr=p.lr, betas=p.betas, eps=p.eps, amsgrad=p.amsgrad, adamw_mode=decoupled,
                  weight_decay=_adam_weight_decay(p, decoupled))
    logger.info("offload_optimizer: %s runs as trident.optim.CPUAdam (torch's fused CPU kernel)", name)
    return opt


def _validate(type_name: Any, params: dict) -> tuple[_Kind | None, Any, list[ConfigIssue]]:
    kind = OPTIMIZERS.get(type_name.lower()) if isinstance(type_name, str) else None
    if kind is None:
        return None, None, [ConfigIssue("optimizer.type", _unknown_type(type_name))]
    params = dict(params)
    issues = []
    if "max_grad_norm" in params:
        del params["max_grad_norm"]
        issues.append(ConfigIssue("optimizer.params.max_grad_norm", (
            "is not an optimizer parameter; use the top-level `gradient_clipping` instead (DeepSpeed rejects "
            "it too)")))
    if kind.name == "Muon":
        params, more = _muon_spellings(params)
        issues += more
    p, more = validate_section(kind.params, params, "optimizer.params")
    issues += more
    return kind, (p if not issues else None), issues


def _unknown_type(type_name: Any) -> str:
    names = [k.name for k in OPTIMIZERS.values()]
    if not isinstance(type_name, str):
        return f"expected one of {', '.join(names)}, got {describe_value(type_name)}"
    for name in _DEEPSPEED_ONLY:
        if name.lower() == type_name.lower():
            return (f"'{type_name}' is a DeepSpeed optimizer that this version of trident does not implement; "
                    f"use one of {', '.join(names)}")
    return unknown_name_message("optimizer type", type_name, names, name_word=True)


def _as_list(group_params: Any) -> list:
    return [group_params] if isinstance(group_params, torch.Tensor) else list(group_params)


def _implementation(params: list) -> dict:
    """Fused kernels when every tensor is on a GPU or every one on the CPU; the multi-tensor
    (foreach) path for a mix."""
    tensors = [t for g in params for t in (g["params"] if isinstance(g, dict) else [g])]
    if tensors and (all(t.is_cuda for t in tensors) or all(t.device.type == "cpu" for t in tensors)):
        return {"fused": True}
    return {"foreach": True}
