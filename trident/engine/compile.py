"""`compile`: torch.compile each transformer block after parallelization, as torchtitan does.

Which modules are blocks:
  a PipelineModule           each of this stage's numbered layers with parameters (a decoder-layer
                             wrapper its adapter names: the model's own layer inside it)
  a model with an adapter    each decoder layer its `ModelAdapter` names (trident.parallel.adapter:
                             GPT's `blocks`, a transformers causal LM's decoder layers)
  anything else              the children of the first ModuleList named blocks, layers or h; with
                             none, the whole model

Each block is compiled in place (`nn.Module.compile`'s mechanism: the module's call goes
through a compiled function set as its `_compiled_call_impl`), so parameter and state-dict
names do not change and checkpoints stay interchangeable with eager runs. The block's hooks run
inside the compiled call; those that must stay eager break the graph:

- ZeRO-3's gather/release hooks (trident.zero.stage3) move parameters between shards and full
  buffers and start collectives; they are wrapped in `torch._dynamo.disable` here, so each
  module that owns parameters costs graph breaks around its own hooks, and the code between
  them is compiled.
- tensor parallelism's mappings (trident.tensor_parallel.mappings) call collectives in autograd
  functions; each runs eagerly (`torch.compiler.disable` there): one break per mapping.

Graph breaks are counted per block on its first call (compilation happens lazily, on the first
step): a backend wrapper counts the graphs each block call runs, breaks = graphs - 1; the
counts are logged once every block has run (docs/compile.md).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from trident.monitor.log import logger
from trident.parallel.adapter import adapter_for
from trident.pipeline.module import PipelineModule
from trident.tensor_parallel.plan import tp_layers

BLOCK_LISTS = ("blocks", "layers", "h")
"""Names of the ModuleList whose children are a generic model's blocks."""

RECOMPILE_LIMIT = 64
"""Dynamo's per-code-object cache limit while compiling blocks: every block's call is one code
object (nn.Module._call_impl), its entries differ by block kind, grad mode (activation
checkpointing reruns) and ZeRO-3 parameter states; torch's default of 8 would silently fall back
to eager on a model with several block kinds."""


def _backend_fn(backend: str) -> str | Callable:
    """A backend name, or the function a `package.module.function` name imports (the config
    checked that it exists)."""
    import torch._dynamo

    if backend in torch._dynamo.list_backends(exclude_tags=()):
        return backend
    module_name, _, fn_name = backend.rpartition(".")
    return getattr(importlib.import_module(module_name), fn_name)


# -- which modules are blocks ------------------------------------------------------------------------

def compile_targets(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every block of `model` to compile, in model order."""
    adapter = adapter_for(model)
    layers = adapter.decoder_layers() if adapter is not None else []
    if isinstance(model, PipelineModule):
        return _pipeline_layers(model, layers)
    if layers:
        return layers
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rpartition(".")[2] in BLOCK_LISTS and len(module):
            return [(f"{name}.{i}", block) for i, block in enumerate(module)]
    return [("", model)]


def _pipeline_layers(model: PipelineModule, decoder_layers: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """This stage's numbered layers with parameters; a layer its adapter names a decoder layer
    inside (a wrapper of the model's own layer) is compiled as that inner module, the wrapper's
    mask/position cache staying eager."""
    inner = {name.partition(".")[0]: (name, module) for name, module in decoder_layers}
    targets = []
    for name, child in model.named_children():
        if not name.isdigit():
            continue  # tied modules run through their forward_fn, outside this stage's numbered layers
        if name in inner:
            targets.append(inner[name])
        elif any(True for _ in child.parameters()):
            targets.append((name, child))
    return targets


# -- counting graphs ---------------------------------------------------------------------------------

_GRAPH_CALLS = [0]
"""Compiled graphs run so far in this process (every block's backend counts here)."""


class _CountingBackend:
    """A torch.compile backend that runs `inner` and counts each call of the graphs it compiles:
    a block call that runs k graphs had k - 1 graph breaks, whether its graphs were compiled for it
    or for an identical block (dynamo's cache does not guard on module identity)."""

    def __init__(self, inner: Callable) -> None:
        self.inner = inner
        self.compiler_name = getattr(inner, "compiler_name", "trident_counting")

    def __call__(self, gm, example_inputs):
        fn = self.inner(gm, example_inputs)

        def run(*args):
            _GRAPH_CALLS[0] += 1
            return fn(*args)

        if getattr(fn, "_boxed_call", False):  # inductor takes its inputs as one list it may free
            run._boxed_call = True
        return run

    def get_compiler_config(self):
        get = getattr(self.inner, "get_compiler_config", None)
        return get() if get is not None else None

    def reset(self) -> None:
        if hasattr(self.inner, "reset"):
            self.inner.reset()


_BACKENDS: dict[str, _CountingBackend] = {}


def _backend(cfg) -> _CountingBackend:
    """One backend object per setting in the process, so blocks (and engines) share dynamo's
    cache entries instead of compiling each block again."""
    options = cfg.compile_kwargs()
    key = repr(sorted((k, v) for k, v in options.items() if k != "fullgraph"))
    if key not in _BACKENDS:
        mode, opts, dynamic = options.get("mode"), options.get("options"), options.get("dynamic")
        if cfg.backend == "inductor":
            inner = torch._TorchCompileInductorWrapper(mode, opts, dynamic)
        else:
            inner = torch._TorchCompileWrapper(_backend_fn(cfg.backend), mode, opts, dynamic)
        _BACKENDS[key] = _CountingBackend(inner)
    return _BACKENDS[key]


@dataclass
class BlockStats:
    """A compiled block's graphs per call (first call), graph breaks (graphs - 1), the calls that
    compiled anew after the first (guard failures: shapes, grad mode, parameter states) and the
    reasons dynamo gave for breaks it met while compiling this block."""

    name: str
    graphs: int | None = None
    recompiles: int = 0
    reasons: list[str] = field(default_factory=list)

    @property
    def graph_breaks(self) -> int | None:
        """graphs - 1; -1 when the block ran no compiled graph (dynamo fell back to eager)."""
        return None if self.graphs is None else self.graphs - 1


class CompileReport:
    """Per-block statistics of one model's compiled blocks; logs them once all have run."""

    def __init__(self, names: list[str], kwargs: dict[str, Any]) -> None:
        self.blocks = {name: BlockStats(name) for name in names}
        self.kwargs = kwargs
        self.logged = False

    def graph_breaks(self) -> dict[str, int | None]:
        """Block name -> graph breaks on its first call (None until it has run, -1 if it ran eagerly)."""
        return {name: s.graph_breaks for name, s in self.blocks.items()}

    def first_call(self, stats: BlockStats, graphs_run: int, reasons: list[str]) -> None:
        stats.graphs, stats.reasons = graphs_run, reasons
        if not graphs_run:
            logger.warning("compile: %s ran no compiled graph (dynamo ran it eagerly; see its recompile limit and "
                           "TORCH_LOGS=recompiles)", stats.name or "the model")
        if not self.logged and all(s.graphs is not None for s in self.blocks.values()):
            self.logged = True
            logger.info(self.summary())

    def summary(self) -> str:
        counts = sorted({s.graph_breaks for s in self.blocks.values()})
        reasons = sorted({r.splitlines()[0] for s in self.blocks.values() for r in s.reasons})
        per = ", ".join(f"{n or '(model)'}: {s.graph_breaks}" for n, s in self.blocks.items())
        text = (f"compile: {len(self.blocks)} block(s) compiled; graph breaks per block "
                f"{'/'.join(map(str, counts))} ({per})")
        return text + (f"; dynamo's reasons: {'; '.join(r[:100] for r in reasons[:4])}" if reasons else "")


class _CountedCall:
    """A block's compiled call, counting the graphs it runs and what dynamo compiles inside it."""

    def __init__(self, compiled: Callable, stats: BlockStats, report: CompileReport,
                 owner: nn.Module | None = None) -> None:
        self.compiled, self.stats, self.report = compiled, stats, report
        self.__self__ = owner  # like a bound forward: activation checkpointing finds the module's RNG streams

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch._dynamo.utils import counters

        first = self.stats.graphs is None
        calls, graphs = _GRAPH_CALLS[0], counters["stats"]["unique_graphs"]
        known = set(counters["graph_break"]) if first else ()
        out = self.compiled(*args, **kwargs)
        if first:
            reasons = sorted(r for r in counters["graph_break"] if r not in known)
            self.report.first_call(self.stats, _GRAPH_CALLS[0] - calls, reasons)
        elif counters["stats"]["unique_graphs"] != graphs:
            self.stats.recompiles += 1
        return out


# -- compiling ---------------------------------------------------------------------------------------

def compile_scope(cfg, device_type: str, whole_model_ok: bool) -> str:
    """`compile.scope` resolved: "model" or "blocks". Unset, it compiles the whole model on a GPU
    when `whole_model_ok` (nothing in it must run eagerly between graphs): there every operator
    outside a graph is a kernel launch of its own, and the embedding, head and loss are a
    sizeable share of a step's launches; on a CPU the blocks are what is worth compiling."""
    if cfg.scope is not None:
        return cfg.scope
    return "model" if device_type == "cuda" and whole_model_ok else "blocks"


def apply_compile(model: nn.Module, cfg, scope: str = "blocks") -> CompileReport | None:
    """Compile `model` as `cfg` (a CompileConfig) says: its whole call (`scope` "model") or every
    block (see the module docstring); None when compilation is off. Call after parallelization,
    before the first forward."""
    if not cfg.enabled:
        return None
    import torch._dynamo

    from trident.tensor_parallel.mappings import keep_mappings_eager
    keep_mappings_eager()
    targets = [("", model)] if scope == "model" else compile_targets(model)
    kwargs = cfg.compile_kwargs()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    # a break inside a submodule (a ZeRO-3 hook, a tp mapping) resumes there, not at the block's
    # call of that submodule: one break each instead of a graph per nesting level
    torch._dynamo.config.nested_graph_breaks = True
    report = CompileReport([name for name, _ in targets], kwargs)
    options = {"backend": _backend(cfg), "fullgraph": bool(kwargs.get("fullgraph")), "dynamic": kwargs.get("dynamic")}
    run = _runner(options)
    for name, block in targets:
        if _keep_hooks_eager(block) and kwargs.get("fullgraph"):
            raise ValueError(f"compile.fullgraph is true, but {name or 'the model'} runs ZeRO-3's gather and "
                             "release hooks, which must stay outside the graph (graph breaks); set "
                             "compile.fullgraph to false, or use ZeRO stage 0-2")
        if kwargs.get("fullgraph") and _has_tensor_parallel_layers(block):
            raise ValueError(f"compile.fullgraph is true, but {name or 'the model'} has tensor-parallel layers, "
                             "whose collectives run eagerly between graphs; set compile.fullgraph to false")
        counted = functools.partial(_CountedCall, stats=report.blocks[name], report=report)
        if isinstance(block.forward, functools.partial) and getattr(block, "_trident_checkpointed", False):
            # activation checkpointing's wrapper stays outside: compile the forward it recomputes
            wrap, (owner, inner) = block.forward.func, block.forward.args
            block.forward = functools.partial(wrap, owner, counted(torch.compile(inner, **options), owner=owner))
        else:
            block._compiled_call_impl = counted(functools.partial(run, block))
    shown = ", ".join(n or "(model)" for n, _ in targets[:3]) + (", ..." if len(targets) > 3 else "")
    logger.info("compile: torch.compile(%s) on %d block(s) (%s); graph breaks are counted on the first step",
                ", ".join(f"{k}={v}" for k, v in kwargs.items()), len(targets), shown)
    return report


def _run_module(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A block's call (its hooks and forward), from a frame dynamo compiles: torch.nn's own frames
    are in dynamo's skip list, so compiling `module._call_impl` itself would leave a block whose
    forward is torch's (a LayerNorm layer of a PipelineModule) eager. The module is an argument,
    not a closure, so identical blocks share one compiled graph."""
    return module._call_impl(*args, **kwargs)


_RUNNERS: dict[tuple, Callable] = {}


def _runner(options: dict[str, Any]) -> Callable:
    """`_run_module` compiled with `options`, one per setting in the process."""
    key = (id(options["backend"]), options["fullgraph"], options["dynamic"])
    if key not in _RUNNERS:
        _RUNNERS[key] = torch.compile(_run_module, **options)
    return _RUNNERS[key]


def _keep_hooks_eager(block: nn.Module) -> int:
    """Wrap the forward hooks of ZeRO-3's coordinator on `block` and its submodules in
    torch._dynamo.disable: they gather and release parameters (collectives, `.data` swaps), which
    must run as written, between compiled pieces. Returns how many were wrapped."""
    import torch._dynamo

    from trident.zero.stage3 import Stage3Coordinator

    wrapped = 0
    for module in block.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key, hook in list(hooks.items()):
                if isinstance(getattr(hook, "__self__", None), Stage3Coordinator):
                    hooks[key] = torch._dynamo.disable(hook)
                    wrapped += 1
    return wrapped


def _has_tensor_parallel_layers(block: nn.Module) -> bool:
    return bool(tp_layers(block))
