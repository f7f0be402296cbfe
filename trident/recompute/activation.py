"""Activation checkpointing: keep a layer's inputs, recompute its insides in backward.

`checkpoint(function, *args)` runs `function` without recording its graph and keeps only its
tensor inputs; backward runs it again with grad enabled and back-propagates through the rerun.
What a user can turn on (DeepSpeed's API: `configure(mpu, ...)`, `checkpoint`, `is_configured`):

- partition_activations: the kept inputs, replicated over the tensor-parallel group, are split
  over it (each rank keeps 1/tp) and all-gathered over `mesh.tp_group` just before the rerun.
  Only meaningful for inputs that *are* replicated over tp; with sequence parallelism they are
  already split along the sequence, and trident.initialize leaves partitioning off (with a
  warning) in that case.
- cpu_checkpointing: the kept inputs live in host memory (pinned when the device is CUDA) and
  go back to the device for the rerun. In a CPU run they are in host memory already and are
  kept as they are (no copy).
- contiguous_memory_optimization: the kept inputs are copied into `number_checkpoints`
  preallocated slots reused every step (no fragmentation from many small saved tensors); a
  slot still in use when its turn comes again is an error naming number_checkpoints.
- synchronize: torch.cuda.synchronize() at each checkpoint boundary (CUDA only).
- profile: wall time of each forward and each rerun, summed in `profile_timings()`.

The rerun replays randomness exactly: the default CPU (and CUDA) generator, every
torch.Generator the function's modules hold (the reference GPT's per-head dropout streams,
`head_rng`) and every RNGTracker they hold are set back to their state at the forward and
restored afterwards. A tracker stream created inside the forward cannot be replayed and is
refused.

Selective checkpointing: `apply_activation_checkpointing(model, layers=[regex, ...], every=k)`
wraps every k-th submodule whose qualified name matches; PipelineModule's
`activation_checkpoint_interval` checkpoints every run of k layers through `checkpoint` too.

Whose settings a call uses. DeepSpeed's API is process-wide (`configure` once, `checkpoint`
anywhere), and so is `configure` here: it sets the process-wide settings, returns them, and
`reset` clears them. A model can also own settings (`make_settings`, then `bind`), as
trident.initialize does with the config section, so that two engines in one process do not
share them. A `checkpoint` call uses, first found:

  1. the settings of the module it runs for: a module wrapped by `apply_activation_checkpointing`
     with `settings=`;
  2. the settings of the model running now: a bound model's forward, or a PipelineModule's
     `run_chunk` (so a model's own direct `checkpoint` calls follow its engine's config);
  3. the process-wide settings of `configure` (defaults when it was not called).
"""

from __future__ import annotations

import functools
import re
import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from trident.monitor.log import logger
from trident.parallel.rng import RNGTracker


@dataclass
class CheckpointSettings:
    """How `checkpoint` keeps inputs: the process-wide ones of `configure`, or a model's own."""

    mesh: Any = None
    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    cpu_checkpointing: bool = False
    number_checkpoints: int | None = None
    synchronize: bool = False
    profile: bool = False
    timings: dict[str, float] = field(default_factory=lambda: {"forward_s": 0.0, "recompute_s": 0.0, "calls": 0})
    slots: "_Slots | None" = None

    @property
    def partition_group(self):
        """The tp group kept inputs are split over, or None (not partitioning, or tp = 1)."""
        mesh = self.mesh
        if self.partition_activations and mesh is not None and getattr(mesh, "tp_size", 1) > 1:
            return mesh.tp_group
        return None


_SETTINGS: CheckpointSettings | None = None
# The settings of the model running now (set by a bound model's forward, or `running`).
_ACTIVE: ContextVar[CheckpointSettings | None] = ContextVar("trident_checkpoint_settings", default=None)
# Attribute naming the settings a module owns (`bind`, `apply_activation_checkpointing`).
_OWN = "_trident_checkpoint_settings"


def configure(mpu_=None, deepspeed_config=None, partition_activations: bool | None = None,
              contiguous_memory_optimization: bool | None = None, cpu_checkpointing: bool | None = None,
              number_checkpoints: int | None = None, synchronize: bool | None = None,
              profile: bool | None = None, *, contiguous_checkpointing: bool | None = None,
              num_checkpoints: int | None = None, checkpoint_in_cpu: bool | None = None) -> CheckpointSettings:
    """Set how `checkpoint` keeps inputs, process-wide (for calls no model owns settings for);
    returns the settings. Arguments as `make_settings`."""
    global _SETTINGS
    _SETTINGS = make_settings(mpu_, deepspeed_config, partition_activations, contiguous_memory_optimization,
                              cpu_checkpointing, number_checkpoints, synchronize, profile,
                              contiguous_checkpointing=contiguous_checkpointing, num_checkpoints=num_checkpoints,
                              checkpoint_in_cpu=checkpoint_in_cpu)
    return _SETTINGS


def make_settings(mpu_=None, deepspeed_config=None, partition_activations: bool | None = None,
                  contiguous_memory_optimization: bool | None = None, cpu_checkpointing: bool | None = None,
                  number_checkpoints: int | None = None, synchronize: bool | None = None,
                  profile: bool | None = None, *, contiguous_checkpointing: bool | None = None,
                  num_checkpoints: int | None = None, checkpoint_in_cpu: bool | None = None) -> CheckpointSettings:
    """New settings, not installed anywhere (`configure` or `bind` installs them). `mpu_` is the
    ParallelMesh (its tp group partitions activations); `deepspeed_config` may be a trident
    Config (or its activation_checkpointing section) whose values fill the arguments left as
    None. DeepSpeed's own argument names (`contiguous_checkpointing`, `num_checkpoints`,
    `checkpoint_in_cpu`) are accepted too."""
    for ours, theirs in ((contiguous_memory_optimization, contiguous_checkpointing),
                         (number_checkpoints, num_checkpoints), (cpu_checkpointing, checkpoint_in_cpu)):
        if ours is not None and theirs is not None and ours != theirs:
            raise ValueError("configure: a setting was given twice with different values (trident's name and "
                             "DeepSpeed's alias); pass one of them")
    contiguous_memory_optimization = _first(contiguous_memory_optimization, contiguous_checkpointing)
    number_checkpoints = _first(number_checkpoints, num_checkpoints)
    cpu_checkpointing = _first(cpu_checkpointing, checkpoint_in_cpu)
    section = getattr(deepspeed_config, "activation_checkpointing", deepspeed_config)
    values = {
        "partition_activations": partition_activations, "contiguous_memory_optimization":
            contiguous_memory_optimization, "cpu_checkpointing": cpu_checkpointing,
        "number_checkpoints": number_checkpoints, "synchronize": synchronize, "profile": profile,
    }
    for key, value in values.items():
        if value is None:
            source = "synchronize_checkpoint_boundary" if key == "synchronize" else key
            values[key] = getattr(section, source, None) if section is not None else None
    settings = CheckpointSettings(mesh=mpu_, **{k: v for k, v in values.items() if v is not None})
    if settings.contiguous_memory_optimization:
        n = settings.number_checkpoints
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"activation_checkpointing.contiguous_memory_optimization needs "
                             f"activation_checkpointing.number_checkpoints (a positive integer: how many "
                             f"checkpointed layers are alive at once), got {n!r}")
        settings.slots = _Slots(n)
    return settings


def _first(value, alias):
    return value if value is not None else alias


def is_configured() -> bool:
    """True once `configure` has been called (and not `reset`)."""
    return _SETTINGS is not None


def reset() -> None:
    """Forget the process-wide settings (models' own settings are kept)."""
    global _SETTINGS
    _SETTINGS = None


def settings() -> CheckpointSettings:
    """The process-wide settings (the defaults when `configure` was not called)."""
    return _SETTINGS if _SETTINGS is not None else CheckpointSettings()


def bind(model: nn.Module, own: CheckpointSettings | None) -> None:
    """Give `model` settings of its own (None: none, the process-wide ones apply again). While
    it runs (its forward, or a PipelineModule's `run_chunk`), `checkpoint` calls use them."""
    setattr(model, _OWN, own)
    if own is not None and not hasattr(model, "_trident_checkpoint_tokens"):
        model._trident_checkpoint_tokens = []
        model.register_forward_pre_hook(_enter)
        model.register_forward_hook(_leave, always_call=True)


def settings_of(module: nn.Module) -> CheckpointSettings:
    """The settings `module`'s checkpointed calls use: its own, else the process-wide ones."""
    own = getattr(module, _OWN, None)
    return own if own is not None else settings()


@contextmanager
def running(module: nn.Module):
    """`checkpoint` calls inside the block use `module`'s own settings, if it has any."""
    token = _ACTIVE.set(getattr(module, _OWN, None) or _ACTIVE.get())
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _enter(module: nn.Module, args: Any) -> None:
    module._trident_checkpoint_tokens.append(_ACTIVE.set(getattr(module, _OWN, None) or _ACTIVE.get()))


def _leave(module: nn.Module, args: Any, output: Any) -> None:
    if module._trident_checkpoint_tokens:  # empty if an earlier pre-hook raised before _enter ran
        _ACTIVE.reset(module._trident_checkpoint_tokens.pop())


def current_settings() -> CheckpointSettings:
    """The settings a `checkpoint` call made now uses: the running model's own, else the
    process-wide ones."""
    active = _ACTIVE.get()
    return active if active is not None else settings()


def profile_timings(module: nn.Module | None = None) -> dict[str, float]:
    """Seconds spent in checkpointed forwards and reruns, and the number of calls (profile=True),
    under the process-wide settings or those `module` uses (`settings_of`)."""
    return dict((settings() if module is None else settings_of(module)).timings)


def checkpoint(function: Callable, *args: Any) -> Any:
    """`function(*args)`, keeping only its tensor inputs for backward (see the module docstring)."""
    return _checkpoint(current_settings(), function, args)


def _checkpoint_module(module: nn.Module, forward: Callable, *args: Any) -> Any:
    """A module wrapped by `apply_activation_checkpointing`: its own settings, else the current."""
    own = getattr(module, _OWN, None)
    return _checkpoint(own if own is not None else current_settings(), forward, args)


def _checkpoint(current: CheckpointSettings, function: Callable, args: tuple) -> Any:
    if not torch.is_grad_enabled():
        return function(*args)
    anchor = torch.empty(0, requires_grad=True)  # backward runs even if no input needs grad
    return _Checkpoint.apply(function, current, _Streams(function, args), anchor, *args)


class _Checkpoint(torch.autograd.Function):
    """Forward without a graph; backward reruns `function` on the kept inputs."""

    @staticmethod
    def forward(ctx, function, current: CheckpointSettings, streams: _Streams, anchor, *args):
        ctx.function, ctx.settings, ctx.streams = function, current, streams
        ctx.rng = streams.capture()
        _sync(current)
        start = time.perf_counter()
        with torch.no_grad():
            outputs = function(*args)
        streams.check_no_new_streams(ctx.rng)
        if current.profile:
            current.timings["forward_s"] += time.perf_counter() - start
            current.timings["calls"] += 1
        ctx.kept = [_Kept(a, current) if isinstance(a, torch.Tensor) else a for a in args]
        ctx.needs = [isinstance(a, torch.Tensor) and a.requires_grad for a in args]
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        current = ctx.settings
        _sync(current)
        inputs = []
        for kept, needs in zip(ctx.kept, ctx.needs):
            if isinstance(kept, _Kept):
                t = kept.restore(current).detach()
                t.requires_grad_(needs)
                inputs.append(t)
            else:
                inputs.append(kept)
        ctx.kept = None
        start = time.perf_counter()
        now = ctx.streams.capture()
        ctx.streams.restore(ctx.rng)
        try:
            with torch.enable_grad():
                outputs = ctx.function(*inputs)
        finally:
            ctx.streams.restore(now)
        if current.profile:
            current.timings["recompute_s"] += time.perf_counter() - start
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if isinstance(o, torch.Tensor) and o.requires_grad
                 and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, None, None) + tuple(t.grad if isinstance(t, torch.Tensor) and needs else None
                                                for t, needs in zip(inputs, ctx.needs))


# -- keeping inputs ------------------------------------------------------------------------------


class _Kept:
    """One kept input: possibly this rank's 1/tp piece, possibly on the host, possibly in a slot."""

    def __init__(self, t: torch.Tensor, current: CheckpointSettings) -> None:
        self.shape, self.device = t.shape, t.device
        data = t.detach()
        group = current.partition_group if t.is_floating_point() else None
        self.group = group
        if group is not None:
            world, rank = current.mesh.tp_size, current.mesh.tp_rank
            flat = data.reshape(-1)
            self.numel = flat.numel()
            per = -(-self.numel // world)
            if per * world != self.numel:
                flat = torch.cat([flat, flat.new_zeros(per * world - self.numel)])
            data = flat[rank * per:(rank + 1) * per].clone()
        to_host = current.cpu_checkpointing and data.device.type != "cpu"
        self.slot = None
        if current.slots is not None:  # one copy, straight into the slot (on the host if to_host)
            self.slot, data = current.slots.take(data, torch.device("cpu") if to_host else data.device)
        elif to_host:
            host = torch.empty(data.shape, dtype=data.dtype, pin_memory=torch.cuda.is_available())
            host.copy_(data, non_blocking=True)  # the rerun's copy back is queued after it
            data = host
        self.data = data

    def restore(self, current: CheckpointSettings) -> torch.Tensor:
        data = self.data.to(self.device, non_blocking=True)
        if self.slot is not None:
            data = data.clone() if data.data_ptr() == self.data.data_ptr() else data
            current.slots.free(self.slot)
        if self.group is not None:
            from trident.comm import collectives
            world = current.mesh.tp_size
            full = torch.empty(world * data.numel(), dtype=data.dtype, device=data.device)
            collectives.all_gather(full, data.contiguous(), group=self.group)
            data = full[:self.numel]
        self.data = None
        return data.view(self.shape)


class _Slots:
    """`number_checkpoints` reusable buffers, taken in turn; each grows to the largest input
    it has held and is reused from then on."""

    def __init__(self, count: int) -> None:
        self.count, self.next = count, 0
        self.buffers: list[torch.Tensor | None] = [None] * count
        self.busy = [False] * count

    def take(self, data: torch.Tensor, device: torch.device) -> tuple[int, torch.Tensor]:
        """Copy `data` into the next slot (a buffer on `device`, pinned if that is the host of
        a CUDA machine); returns the slot and the copy."""
        slot = self.next
        if self.busy[slot]:
            raise RuntimeError(f"activation_checkpointing.number_checkpoints={self.count} is too small: slot "
                               f"{slot} is still held by an earlier checkpoint whose backward has not run. Set "
                               f"it to the number of checkpointed layers alive at once (layers x micro-batches "
                               f"in flight)")
        self.next = (slot + 1) % self.count
        buf = self.buffers[slot]
        nbytes = data.numel() * data.element_size()
        if buf is None or buf.device != device or buf.numel() < nbytes:
            pin = device.type == "cpu" and torch.cuda.is_available()
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pin)
            self.buffers[slot] = buf
        view = buf[:nbytes].view(data.dtype).view(data.shape)
        view.copy_(data, non_blocking=True)
        self.busy[slot] = True
        return slot, view

    def free(self, slot: int) -> None:
        self.busy[slot] = False


# -- randomness ------------------------------------------------------------------------------------


class _Streams:
    """Every random stream a checkpointed function can draw from: the default CPU (and CUDA)
    generator, the torch.Generators its modules hold (the GPT's per-head `head_rng`), and the
    RNGTrackers they hold (through their public get_states / set_states)."""

    def __init__(self, function: Callable, args: tuple) -> None:
        self.generators: list[torch.Generator] = []
        self.trackers: list[RNGTracker] = []
        seen: set[int] = set()
        for root in _modules_of(function, args):
            for module in root.modules():
                for value in vars(module).values():
                    for item in value if isinstance(value, (list, tuple)) else (value,):
                        if isinstance(item, (torch.Generator, RNGTracker)) and id(item) not in seen:
                            seen.add(id(item))
                            (self.trackers if isinstance(item, RNGTracker) else self.generators).append(item)

    def capture(self) -> tuple:
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return (torch.get_rng_state(), cuda, [g.get_state() for g in self.generators],
                [t.get_states() for t in self.trackers])

    def restore(self, states: tuple) -> None:
        cpu, cuda, generators, trackers = states
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)
        for gen, state in zip(self.generators, generators):
            gen.set_state(state)
        for tracker, state in zip(self.trackers, trackers):
            tracker.set_states(state)

    def check_no_new_streams(self, before: tuple) -> None:
        """A stream an RNGTracker creates inside the forward cannot be replayed (its state at
        creation is gone by backward): refuse it instead of recomputing different masks."""
        for tracker, states in zip(self.trackers, before[3]):
            new = sorted(set(tracker.get_states()) - set(states))
            if new:
                raise RuntimeError(f"RNG streams {new} were created inside a checkpointed function, so "
                                   f"recomputation cannot replay them; create them before the first "
                                   f"forward (e.g. RNGTracker.unit_generators when building the model)")


def _modules_of(function: Callable, args: tuple) -> list[nn.Module]:
    """The modules a checkpointed call runs: a bound forward's module, a partial's arguments,
    module arguments, lists of modules (a PipelineModule's run of layers)."""
    modules = []
    for obj in (function, getattr(function, "__self__", None), getattr(function, "func", None),
                *getattr(function, "args", ()), *args):
        if isinstance(obj, nn.Module):
            modules.append(obj)
        elif isinstance(obj, (list, tuple)):
            modules += [m for m in obj if isinstance(m, nn.Module)]
    return modules


def _sync(current: CheckpointSettings) -> None:
    if current.synchronize and torch.cuda.is_available():
        torch.cuda.synchronize()


# -- selective checkpointing -------------------------------------------------------------------------


def apply_activation_checkpointing(model: nn.Module, layers: list[str], every: int = 1,
                                   settings: CheckpointSettings | None = None) -> list[str]:
    """Checkpoint every `every`-th submodule whose qualified name fully matches one of the
    regexes `layers` (counted in module order); returns the names wrapped now. `settings`: the
    modules' own (trident.initialize passes its engine's); None = those current when they run."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"activation_checkpointing.every must be a positive integer, got {every!r}")
    patterns = []
    for pattern in layers:
        try:
            patterns.append(re.compile(pattern))
        except re.error as err:
            raise ValueError(f"activation_checkpointing.layers: {pattern!r} is not a valid regular expression "
                             f"({err})") from None
    matches = [(name, m) for name, m in model.named_modules()
               if name and any(p.fullmatch(name) for p in patterns)]
    if layers and not matches:
        sample = ", ".join(name for name, _ in list(model.named_modules())[1:6])
        raise ValueError(f"activation_checkpointing.layers {layers} match no submodule of "
                         f"{type(model).__name__} (its modules are named like: {sample}, ...)")
    wrapped = []
    for name, module in matches[::every]:
        setattr(module, _OWN, settings)
        if not getattr(module, "_trident_checkpointed", False):
            module.forward = functools.partial(_checkpoint_module, module, module.forward)
            module._trident_checkpointed = True
            wrapped.append(name)
    logger.info("activation checkpointing: %d module(s) recompute in backward (%s%s)", len(wrapped),
                ", ".join(wrapped[:4]), ", ..." if len(wrapped) > 4 else "")
    return wrapped
