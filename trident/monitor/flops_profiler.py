"""DeepSpeed's FLOPs profiler, counted by `torch.utils.flop_counter.FlopCounterMode`.

What a rank computes is counted where it runs: every operator with a FLOP formula in torch's
flop counter (matrix multiplies, convolutions, fused attention) is counted as it dispatches,
forward and backward apart (backward is what runs inside autograd's engine). A forward re-run
inside backward (activation checkpointing) counts as backward and, because it runs with
gradients on to rebuild its graph, as recomputation too. Operators without a formula
(element-wise work, norms, softmax) count nothing, as in torch's counter: the figures are
matmul FLOPs, and MACs are half of them.

On top of the counter, forward hooks on every module give DeepSpeed's per-module view: the
module's parameters, the forward FLOPs counted while it ran (its children's included), its
forward latency and its calls (a module re-run in backward does not add to them).

    prof = FlopsProfiler(model)
    prof.start_profile()
    loss = model(batch)
    prof.stop_profile()
    prof.print_model_profile(profile_step=1)   # or prof.get_total_flops(), ...
    prof.end_profile()

`get_model_profile(model, input_shape=...)` profiles one forward and returns (FLOPs, MACs,
parameters), as DeepSpeed's does. The training engine profiles one whole optimizer step
(`trident.engine.flops`); `trident.monitor.flops_report` writes the report.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

import trident.monitor.flops_report as flops_report

aten = torch.ops.aten


def _cpu_attention(args, kwargs) -> int:
    q, k, v = args[:3]
    return flop_counter.sdpa_flop_count(q.shape, k.shape, v.shape)


def _cpu_attention_backward(args, kwargs) -> int:
    grad_out, q, k, v = args[:4]
    return flop_counter.sdpa_backward_flop_count(grad_out.shape, q.shape, k.shape, v.shape)


EXTRA_FORMULAS: dict[Any, Callable] = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
}
"""Formulas torch's counter lacks: the CPU kernel of scaled_dot_product_attention, counted as
torch counts the GPU kernels (the whole score matrix, causal or not; backward recomputes the
scores: 5 batched matmuls to the forward's 2), so a CPU run and a GPU run count alike."""


@dataclass
class ModuleStats:
    """One module of this rank's model: where it is, what it holds, what its forward did."""

    name: str        # path in the model, "" for the model itself
    kind: str        # class name
    depth: int       # 0 for the model, 1 for its children, ...
    split_params: int       # elements of tensor-parallel shards (each tp rank holds its own)
    replicated_params: int  # elements every tp rank holds alike
    flops: int = 0          # forward FLOPs while it ran, children included
    seconds: float = 0.0    # forward latency, children included
    calls: int = 0

    @property
    def params(self) -> int:
        return self.split_params + self.replicated_params

    def as_tuple(self) -> tuple:
        return (self.name, self.kind, self.depth, self.split_params, self.replicated_params, self.flops,
                self.seconds, self.calls)


class FlopsProfiler:
    """DeepSpeed's `FlopsProfiler(model, ds_engine=None, recompute_fwd_factor=0.0)`.

    `full_shape(param)` gives a parameter's shape as the model defines it (ZeRO-3 holds
    placeholders; the engine passes its strategy's); default: the tensor's own shape.
    """

    def __init__(self, model: nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0,
                 full_shape: Callable[[torch.Tensor], tuple[int, ...]] | None = None) -> None:
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.full_shape = full_shape or (lambda t: tuple(t.shape))
        self.started = self._entered = False
        self.forward_flops = self.backward_flops = self.recompute_flops = 0
        self.tokens = 0
        self.modules: dict[str, ModuleStats] = {}
        self._counter = FlopCounterMode(display=False, custom_mapping=self._formulas())
        self._handles: list = []
        self._stack: list[tuple[str, float, int]] = []
        self._first_module: nn.Module | None = None
        self._sync = False
        self.reset_profile()

    # -- counting ------------------------------------------------------------------------------

    def _formulas(self) -> dict[Any, Callable]:
        """Every formula of torch's counter (and `EXTRA_FORMULAS`), wrapped to add its count to
        the forward or the backward total as it runs."""
        def bucketed(formula: Callable, raw_args: bool) -> Callable:
            def count(*args, out_val=None, **kwargs) -> int:
                n = formula(args, kwargs) if raw_args else formula(*args, out_val=out_val, **kwargs)
                if self._counter.mod_tracker.is_bw:
                    self.backward_flops += n
                    if torch.is_grad_enabled():  # a forward re-run in backward builds a graph: recomputation
                        self.recompute_flops += n
                else:
                    self.forward_flops += n
                return n
            count._get_raw = True  # FlopCounterMode hands the formula the tensors themselves
            return count
        formulas = {op: bucketed(f, False) for op, f in flop_counter.flop_registry.items()}
        formulas.update({op: bucketed(f, True) for op, f in EXTRA_FORMULAS.items()})
        return formulas

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count what runs inside (hooks must be on: `add_hooks`, or `start_profile`)."""
        with self._counter:
            yield

    def reset_profile(self) -> None:
        """Zero every figure; list the modules and their parameters afresh."""
        self.forward_flops = self.backward_flops = self.recompute_flops = 0
        self.tokens = self._rows = 0
        self._first_module = None
        self.modules = {}
        shape = self.full_shape
        for name, module in self.model.named_modules():
            split = replicated = 0
            for p in module.parameters():
                n = math.prod(shape(p))
                if getattr(p, "tensor_model_parallel", False):
                    split += n
                else:
                    replicated += n
            depth = 0 if not name else name.count(".") + 1
            self.modules[name] = ModuleStats(name, type(module).__name__, depth, split, replicated)

    def reset_timings(self) -> None:
        """Zero the latencies, calls and tokens; keep the FLOPs (a second step, timed only)."""
        for stats in self.modules.values():
            stats.seconds, stats.calls = 0.0, 0
        self.tokens = self._rows = 0
        self._first_module = None

    def add_hooks(self, ignore_list: list[type] | None = None) -> None:
        """Forward hooks on every module (not those of a type in `ignore_list`)."""
        if self._handles:
            return
        first = next(self.model.parameters(), None)
        self._sync = first is not None and first.device.type == "cuda"
        for name, module in self.model.named_modules():
            if ignore_list and type(module) in ignore_list:
                continue
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post_hook(name)))

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._stack = []

    def clock(self) -> float:
        """Seconds, after the device's queued work (CUDA) has finished."""
        if self._sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _pre_hook(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self._counter.mod_tracker.is_bw:  # re-run in backward (recomputation): not the forward's
                return
            if not self._stack:
                self._count_tokens(module, args, kwargs)
            self._stack.append((name, self.clock(), self.forward_flops))
        return hook

    def _post_hook(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not self._stack or self._stack[-1][0] != name:
                return  # re-run in backward, or entered before the hooks were added
            _, start, flops = self._stack.pop()
            stats = self.modules[name]
            stats.seconds += self.clock() - start
            stats.flops += self.forward_flops - flops
            stats.calls += 1
        return hook

    def _count_tokens(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Tokens: the elements of token-id (integer) inputs of outermost calls; without any,
        the rows (all dimensions but the last) of the first input of the first module called."""
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        ids = next((t for t in tensors if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool),
                   None)
        if self._first_module is None:
            self._first_module = module
        if ids is not None:
            self.tokens += ids.numel()
        elif module is self._first_module and tensors and tensors[0].dim() > 0:
            self._rows += tensors[0].numel() // max(1, tensors[0].shape[-1])

    @property
    def counted_tokens(self) -> int:
        return self.tokens or self._rows

    # -- DeepSpeed's API -------------------------------------------------------------------------

    def start_profile(self, ignore_list: list[type] | None = None) -> None:
        """Zero the figures, hook every module and start counting (DeepSpeed's call)."""
        self.reset_profile()
        self.add_hooks(ignore_list)
        self._counter.__enter__()
        self.started = self._entered = True

    def stop_profile(self) -> None:
        """Stop counting and unhook; the figures stay readable."""
        if self._entered:
            self._counter.__exit__(None, None, None)
            self._entered = False
        self.remove_hooks()

    def end_profile(self) -> None:
        """Stop, and drop the figures."""
        if not self.started:
            return
        self.stop_profile()
        self.started = False
        self.reset_profile()

    def get_total_flops(self, as_string: bool = False) -> int | str:
        """Forward FLOPs of the model."""
        return flops_report.number_to_string(self.forward_flops) if as_string else self.forward_flops

    def get_total_macs(self, as_string: bool = False) -> int | str:
        """Forward multiply-accumulates: half the FLOPs (every counted operator is a matmul)."""
        macs = self.forward_flops // 2
        return flops_report.macs_to_string(macs) if as_string else macs

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Forward latency: the model's own calls, or its outermost modules' when it was not called."""
        seconds = self.module_totals()[""].seconds
        return flops_report.duration_to_string(seconds) if as_string else seconds

    def get_total_params(self, as_string: bool = False) -> int | str:
        params = self.modules[""].params
        return flops_report.params_to_string(params) if as_string else params

    def rank_profile(self, **extra: Any) -> dict:
        """This rank's figures as plain data (what the ranks gather), with `extra` entries."""
        return {"modules": [m.as_tuple() for m in self.module_totals().values()], "forward": self.forward_flops,
                "backward": self.backward_flops, "recompute": self.recompute_flops, "tokens": self.counted_tokens,
                "root_params": (self.modules[""].split_params, self.modules[""].replicated_params),
                "forward_seconds": self.get_total_duration(), **extra}

    def module_totals(self) -> dict[str, ModuleStats]:
        """Every module's figures; a container never called itself (ModuleList) gets the sum of
        its children's, as DeepSpeed's totals do."""
        stats = {name: ModuleStats(**vars(m)) for name, m in self.modules.items()}
        children: dict[str, list[ModuleStats]] = {}
        for m in stats.values():
            if m.depth:
                children.setdefault(m.name.rpartition(".")[0], []).append(m)
        for m in sorted(stats.values(), key=lambda m: -m.depth):
            if m.calls == 0:
                m.flops = sum(c.flops for c in children.get(m.name, []))
                m.seconds = sum(c.seconds for c in children.get(m.name, []))
        return stats

    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: str | None = None) -> None:
        """Print this rank's report (to `output_file` when given), as DeepSpeed's does."""
        if not self.started:
            return
        profile = flops_report.merge([self.rank_profile(coords={})])
        text = flops_report.render(profile, step=profile_step, module_depth=module_depth, top_modules=top_modules,
                                   detailed=detailed, recompute_fwd_factor=self.recompute_fwd_factor)
        flops_report.emit(text, output_file)

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> None:
        """Print the top modules by parameters, MACs and latency at each depth."""
        profile = flops_report.merge([self.rank_profile(coords={})])
        print("\n".join(flops_report.aggregated_lines(profile, module_depth, top_modules)))


def get_model_profile(model: nn.Module, input_shape: tuple | None = None, args: list | None = None,
                      kwargs: dict | None = None, print_profile: bool = True, detailed: bool = True,
                      module_depth: int = -1, top_modules: int = 1, warm_up: int = 1, as_string: bool = True,
                      output_file: str | None = None, ignore_modules: list[type] | None = None,
                      mode: str = "forward") -> tuple:
    """(FLOPs, MACs, parameters) of one forward of `model` (DeepSpeed's function and arguments):
    on `args` / `kwargs`, or on one tensor of `input_shape` in the model's dtype."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"get_model_profile: model must be a torch.nn.Module, got {type(model).__name__}")
    if mode not in ("forward", "generate"):
        raise ValueError(f"get_model_profile: mode must be 'forward' or 'generate', got {mode!r}")
    args, kwargs = list(args or []), dict(kwargs or {})
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape:
            raise ValueError(f"get_model_profile: input_shape must be a non-empty tuple, got {input_shape!r}")
        first = next(model.parameters(), None)
        like = first if first is not None else torch.empty(())
        args = [torch.ones(input_shape, dtype=like.dtype, device=like.device)]
    if not args and not kwargs:
        raise ValueError("get_model_profile: give input_shape, or args and/or kwargs for the model")
    run = model.generate if mode == "generate" else model
    model.eval()
    with torch.no_grad():
        for _ in range(warm_up):
            run(*args, **kwargs)
        prof = FlopsProfiler(model)
        prof.start_profile(ignore_list=ignore_modules)
        run(*args, **kwargs)
        prof.stop_profile()
    flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
    if print_profile:
        prof.print_model_profile(profile_step=warm_up, module_depth=module_depth, top_modules=top_modules,
                                 detailed=detailed, output_file=output_file)
    prof.end_profile()
    if as_string:
        return (flops_report.number_to_string(flops), flops_report.macs_to_string(macs),
                flops_report.params_to_string(params))
    return flops, macs, params
