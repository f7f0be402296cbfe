"""The shape of the package, read from the source (docs/architecture.md, "Layers").

Every module belongs to a layer (by the longest matching prefix in LAYERS). A module imports
only its own layer or lower ones, never a layer above; no two modules import each other, however
indirectly; no module imports another package's private name; no module is over 500 lines. The
import graph comes from `ast`, function-level imports included: an import placed inside a
function to dodge a circle is still an import. `trident/__init__.py` is the public facade: it may
import anything, and nothing inside the package imports it. A few earlier rules stay: comm is
the floor, config never imports optim (optim registers its section rules with config's loader).
"""

from __future__ import annotations

import ast
import sys
from functools import lru_cache
from pathlib import Path

import pytest

import trident
from trident.config import ConfigError, load_config
from trident.config import loader

ROOT = Path(trident.__file__).parent
MAX_LINES = 500

LAYERS: dict[str, int] = {
    "trident.config": 0, "trident.configs": 0, "trident.version": 0, "trident.deepspeed.config": 0,
    "trident.comm": 1, "trident.deepspeed.comm": 1,
    "trident.parallel": 2,
    "trident.optim": 3, "trident.precision": 3, "trident.data": 3, "trident.monitor": 3,
    "trident.reliability": 3, "trident.compression": 3, "trident.recompute": 3,
    "trident.tensor_parallel": 4, "trident.pipeline": 4, "trident.context_parallel": 4, "trident.moe": 4,
    "trident.zero": 4, "trident.data_parallel": 4, "trident.peft": 4, "trident.parameter_server": 4,
    "trident.checkpointing": 5,
    "trident.models": 6,
    "trident.planner": 7,
    "trident.engine": 8, "trident.deepspeed.engine": 8, "trident.hf": 8,
    "trident.integrations": 9, "trident.deepspeed": 9, "trident.testing": 9,
    "trident.pipe": 9, "trident.ops": 9, "trident.utils": 9,  # DeepSpeed's module paths, kept as re-exports
    "trident.profiling": 9,
    "trident.tools": 10, "trident.trainer": 10,
    "trident.diagnostics": 10, "trident.planner.check": 10,  # old public paths, re-exporting reliability / tools
    "trident.cli": 11,
}
"""Bottom to top. The DeepSpeed dialect is one package whose modules sit where their imports put
them: its config translation beside config, its comm surface beside comm, its engine aliases
beside the engine, the rest (module surface, checkpoint import) above the engine."""


def module_name(path: Path) -> str:
    parts = ("trident",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@lru_cache(maxsize=1)
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def layer_of(module: str) -> int | None:
    best = max((prefix for prefix in LAYERS if module == prefix or module.startswith(prefix + ".")),
               key=len, default=None)
    return LAYERS[best] if best is not None else None


@lru_cache(maxsize=1)
def imports() -> dict[str, dict[str, list[str]]]:
    """module -> {imported trident module: [names imported from it]}. `from a.b import c` is an
    import of the module a.b.c when that exists, else of the name c from a.b."""
    known = modules()
    out: dict[str, dict[str, list[str]]] = {}
    for mod, path in known.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        found: dict[str, list[str]] = {}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("trident"):
                        found.setdefault(_existing(alias.name, known), [])
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                if not base.startswith("trident"):
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in known:
                        found.setdefault(sub, [])
                    else:
                        found.setdefault(_existing(base, known), []).append(alias.name)
        found.pop(mod, None)
        out[mod] = found
    return out


def _existing(name: str, known: dict[str, Path]) -> str:
    while name not in known and "." in name:
        name = name.rpartition(".")[0]
    return name


def test_every_module_has_a_layer():
    assert [m for m in modules() if m != "trident" and layer_of(m) is None] == []


def test_no_import_runs_up_the_layers():
    upward = []
    for mod, targets in imports().items():
        if mod == "trident":
            continue
        for target in targets:
            if target == "trident":
                upward.append(f"{mod} imports the trident facade")
            elif layer_of(target) > layer_of(mod):
                upward.append(f"{mod} (layer {layer_of(mod)}) imports {target} (layer {layer_of(target)})")
    assert upward == []


def test_no_import_circles():
    graph = {m: set(t) for m, t in imports().items()}
    circles = [sorted(c) for c in _strongly_connected(graph) if len(c) > 1]
    assert circles == []


def test_no_module_imports_through_its_own_package_s_init():
    """`from trident.zero import zeropp` inside trident.zero runs the package's `__init__` first,
    which imports the very modules being loaded: an import circle that only the import order
    hides. Inside a package, import the submodule itself."""
    found = []
    for mod, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module and mod.startswith(node.module + ".") \
                    and modules().get(node.module, Path()).name == "__init__.py":
                found.append(f"{mod}: from {node.module} import ...")
    assert found == []


def test_no_private_names_of_other_packages():
    bad = []
    for mod, targets in imports().items():
        for target, names in targets.items():
            if _package(target) == _package(mod):
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            private += [target] if any(p.startswith("_") and not p.startswith("__") for p in target.split(".")) else []
            bad += [f"{mod} imports {target}.{n}" for n in private]
    assert bad == []


def test_no_module_over_500_lines():
    long = {m: n for m, p in modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iteratively (the graph has a few hundred modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == node:
                        break
                found.append(component)
    return found


def test_comm_imports_only_comm():
    """comm is the floor (the flight recorder lives in it); it re-exports the deepspeed.comm surface."""
    allowed = ("trident.comm", "trident.deepspeed.comm")
    assert {m: sorted(t) for m, t in imports().items() if m.startswith(allowed)
            and any(not x.startswith(allowed) for x in t)} == {}


def test_config_does_not_import_optim_or_the_deepspeed_dialect():
    """optim registers its section rules and the DeepSpeed dialect its translation with config's
    loader; config itself knows trident's own sections only."""
    assert {m: t for m, t in imports().items() if m.startswith("trident.config.") or m == "trident.config"
            if any(x.startswith(("trident.optim", "trident.deepspeed")) for x in t)} == {}


def test_deepspeed_config_imports_only_config():
    allowed = ("trident.config", "trident.deepspeed.config")
    assert {m: t for m, t in imports().items() if m.startswith("trident.deepspeed.config")
            and any(not x.startswith(allowed) for x in t)} == {}


def test_the_parallel_packages_never_name_a_model_family():
    """tensor, pipeline and context parallelism, ZeRO and the engine ask `adapter_for(model)`."""
    families = [m for m in modules() if m.startswith("trident.models.") and m.count(".") >= 2]
    assert {m: [x for x in t if x in families or x.startswith("trident.models")] for m, t in imports().items()
            if m != "trident" and (layer_of(m) <= 5 or m.startswith("trident.engine"))
            and any(x.startswith("trident.models") for x in t)} == {}


def test_flight_recorder_is_comm_s_and_diagnostics_reads_it():
    from trident import diagnostics
    from trident.comm import recorder

    assert diagnostics.FlightRecorder is recorder.FlightRecorder
    assert diagnostics.active_recorder() is recorder.active


def test_optim_rules_are_registered_by_importing_trident():
    assert set(loader._section_rules) == set(loader.TYPED_SECTIONS)
    with pytest.raises(ConfigError, match=r"optimizer\.params\.lr"):
        load_config({"optimizer": {"type": "Adam", "params": {"lr": -1}}})


def test_a_missing_registration_is_loud_not_a_silent_skip(monkeypatch):
    monkeypatch.setattr(loader, "_section_rules", {})
    assert load_config({}).optimizer is None  # no typed section: no rules needed
    with pytest.raises(RuntimeError, match="no rules are registered for the `scheduler` section"):
        load_config({"scheduler": {"type": "WarmupLR", "params": {}}})


def test_only_typed_sections_take_rules():
    with pytest.raises(ValueError, match="'zero_optimization' is not one of optimizer, scheduler"):
        loader.register_section_rules("zero_optimization", lambda t, p: [], lambda s: s)


def test_the_checks_see_a_planted_violation(tmp_path, monkeypatch):
    """The graph reader is not blind: a module of layer 4 importing one of layer 8 inside a
    function, and a private name of another package, are both found."""
    fake = tmp_path / "trident"
    (fake / "zero").mkdir(parents=True)
    (fake / "engine").mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "zero" / "__init__.py").write_text("")
    (fake / "engine" / "__init__.py").write_text("")
    (fake / "engine" / "engine.py").write_text("def _secret():\n    pass\n")
    (fake / "zero" / "stage9.py").write_text("def f():\n    from trident.engine.engine import _secret\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    modules.cache_clear()
    imports.cache_clear()
    try:
        assert imports()["trident.zero.stage9"] == {"trident.engine.engine": ["_secret"]}
        with pytest.raises(AssertionError, match="layer 4.*layer 8"):
            test_no_import_runs_up_the_layers()
        with pytest.raises(AssertionError, match="_secret"):
            test_no_private_names_of_other_packages()
    finally:
        modules.cache_clear()
        imports.cache_clear()


def test_deepspeed_dialect_is_registered_by_importing_trident():
    from trident.config import dialect
    from trident.deepspeed.config import DEEPSPEED

    assert dialect.registered_dialect() is DEEPSPEED
    with pytest.raises(ConfigError, match=r"autotuning: \{\"enabled\": true\} asks for DeepSpeed's autotuner"):
        load_config({"autotuning": {"enabled": True}})


def test_a_missing_dialect_is_loud_not_a_silent_skip(monkeypatch):
    from trident.config import dialect

    monkeypatch.setattr(dialect, "_registered", None)
    with pytest.raises(RuntimeError, match="no config dialect is registered"):
        load_config({})
