"""ZeRO-3's float8 all-gather (`fp8.all_gather`): torchao Float8Linear weights travel as float8.

torchao's tensorwise recipe casts a linear layer's whole weight to float8 (e4m3) with one scale,
`amax_to_scale(max |W|)`, inside each matmul. Under ZeRO-3 each rank holds flat shards of that
weight, so each shard can be cast before its all-gather instead of after it: every rank takes
the amax of its shard of every such weight, one all-reduce (max) gives each weight's whole amax
(the same number one process computes), and each shard is cast with torchao's own
`hp_tensor_and_scale_to_float8`. The cast is element-wise, so the gathered bytes are the bytes
of casting the whole weight, and the all-gather moves one byte per element. The scales are
computed once per change of the shards (after each optimizer step, checkpoint load or
`zero.GatheredParameters` write-back), at the first gather that needs them.

Each converted layer's weight is a unit of its own (its bias another one: trident.zero.units), and
its forward runs torchao's `matmul_with_hp_or_float8_args` with the gathered `Float8TrainingTensor`
as the weight, which torchao uses as it is. The autograd node saves only the input; its
backward runs torchao's own backward on the weight ZeRO-3 gathered again (in float8) when backward
reached the module, and hands the high-precision weight gradient to the weight `Parameter`,
so ZeRO-3's gradient reduction sees it as before. While a unit is gathered in float8 the weight
Parameter points at a zero-strided placeholder of its shape (autograd checks gradient shapes
against it); its values live in the float8 tensor only, so `zero.GatheredParameters` and
checkpoints gather the stored values instead (the coordinator's `exact` gathers).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from trident.comm import collectives
from trident.precision.fp8 import float8_linear_class


def fp8_gather_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The converted layers whose weights can be gathered in float8: torchao's own Float8Linear
    (not a tp-split subclass), dynamic tensorwise weight scaling, the weight used by no other module."""
    from torchao.float8.config import ScalingGranularity, ScalingType
    cls = float8_linear_class()
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return [m for m in model.modules() if type(m) is cls and owners[id(m.weight)] == 1
            and m.config.cast_config_weight.scaling_type is ScalingType.DYNAMIC
            and m.config.cast_config_weight.scaling_granularity is ScalingGranularity.TENSORWISE
            and m.config.cast_config_weight_for_grad_input == m.config.cast_config_weight]


class Float8Gather:
    """The float8 side of a Stage3Coordinator: scales, the cast of shards, the gathered weights."""

    def __init__(self, coordinator, modules: dict) -> None:
        self.coordinator = coordinator
        self.modules = modules  # unit key -> its Float8Linear (the unit holds the weight alone)
        self.scales: dict | None = None  # unit key -> float32 scale of the whole weight; None = stale
        self.weights: dict = {}  # unit key -> gathered Float8TrainingTensor
        self._shapes: dict = {}
        for key, m in modules.items():
            m.forward = functools.partial(_gathered_forward, m, self, key)

    def stale(self) -> None:
        """The shards changed: the next gather takes the amaxes again."""
        self.scales = None

    @torch.no_grad()
    def _refresh(self) -> None:
        """Every FP8 weight's scale from its whole amax: one all-reduce (max) of this rank's
        shard amaxes per partition group's communicator (one for a dense model)."""
        from torchao.float8.float8_utils import amax_to_scale
        by_group: dict[int, list] = {}
        for key in self.modules:
            by_group.setdefault(id(self.coordinator.units[key][0].comm.group), []).append(key)
        scales = {}
        for keys in by_group.values():
            comm = self.coordinator.units[keys[0]][0].comm
            # max |x| of every shard in one multi-tensor kernel (the infinity norm), not one per weight
            amax = torch.stack(torch._foreach_norm([self.coordinator._shard(k) for k in keys], float("inf"))).float()
            if comm.world > 1:
                collectives.all_reduce(amax, torch.distributed.ReduceOp.MAX, group=comm.group,
                                       logger=self.coordinator.zero.logger)
            for key, a in zip(keys, amax):
                c = self.modules[key].config
                scales[key] = amax_to_scale(a, c.cast_config_weight.target_dtype, c.round_scales_to_power_of_2)
        self.scales = scales

    @torch.no_grad()
    def cast(self, key) -> torch.Tensor:
        """This rank's shard of a weight as float8 bytes (uint8, one per element), scaled for the whole weight."""
        from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8
        if self.scales is None:
            self._refresh()
        m = self.modules[key]
        bits = hp_tensor_and_scale_to_float8(self.coordinator._shard(key), self.scales[key],
                                             m.config.cast_config_weight.target_dtype, m.linear_mm_config,
                                             GemmInputRole.WEIGHT)
        return bits._data.view(torch.uint8)

    def arrived(self, key, full: torch.Tensor) -> None:
        """A weight's float8 bytes are whole: wrap them for torchao; the Parameter gets a
        placeholder of its shape."""
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole
        m = self.modules[key]
        shape, dtype = self._shape_of(key)
        data = full.view(m.config.cast_config_weight.target_dtype)[:shape.numel()].view(shape)
        self.weights[key] = Float8TrainingTensor(data, self.scales[key], dtype, m.linear_mm_config,
                                                 GemmInputRole.WEIGHT)
        m.weight.data = torch.zeros((), dtype=dtype, device=full.device).expand(shape)

    def _shape_of(self, key) -> tuple[torch.Size, torch.dtype]:
        found = self._shapes.get(key)
        if found is None:
            pg, unit = self.coordinator.units[key]
            found = self._shapes[key] = (torch.Size(unit.slots[0].shape), pg.params[unit.slots[0].index].dtype)
        return found

    def weight(self, key) -> torch.Tensor:
        """The layer's float8 weight: the gathered one, or (the unit gathered whole in the
        compute dtype, e.g. held by zero.GatheredParameters) torchao's cast of the whole weight."""
        w = self.weights.get(key)
        if w is not None:
            return w
        from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
        from torchao.float8.float8_training_tensor import GemmInputRole
        m = self.modules[key]
        if key not in self.coordinator.full:
            raise RuntimeError(f"the float8 weight of {type(m).__name__} unit {key} is not gathered; "
                               "its ZeRO-3 hooks did not run before it")
        return hp_tensor_to_float8_dynamic(m.weight.detach(), m.config.cast_config_weight.target_dtype,
                                           m.linear_mm_config, gemm_input_role=GemmInputRole.WEIGHT,
                                           round_scales_to_power_of_2=m.config.round_scales_to_power_of_2)

    def released(self, key) -> None:
        self.weights.pop(key, None)


def _gathered_forward(module, gather: Float8Gather, key, x: torch.Tensor) -> torch.Tensor:
    """Float8Linear.forward with the weight ZeRO-3 gathered in float8."""
    if torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    out = _GatheredFloat8Matmul.apply(x, module.weight, gather, key, module)
    if module.bias is not None:
        out = out + module.bias.to(out.dtype)
    return out


class _GatheredFloat8Matmul(torch.autograd.Function):
    """x @ W.t() with W the gathered float8 weight; the gradient goes to the weight Parameter
    (in its dtype). Saves only x: backward reads the float8 weight ZeRO-3 gathers again."""

    @staticmethod
    def forward(ctx, x, weight, gather, key, module):
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
        ctx.save_for_backward(x)
        ctx.gather, ctx.key, ctx.module = gather, key, module
        w8 = gather.weight(key)
        return matmul_with_hp_or_float8_args.apply(x, w8.t(), module.linear_mm_config, module.config)

    @staticmethod
    def backward(ctx, grad):
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
        x, = ctx.saved_tensors
        w8 = ctx.gather.weight(ctx.key)
        # torchao's own backward (the two float8 GEMMs), given what its forward would have saved
        saved = SimpleNamespace(saved_tensors=(x, w8.t()), config=ctx.module.config,
                                linear_mm_config=ctx.module.linear_mm_config)
        grad_x, grad_w_t, _, _ = matmul_with_hp_or_float8_args.backward(saved, grad)
        return grad_x, grad_w_t.t(), None, None, None
