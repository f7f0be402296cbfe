"""Packages depend downward only (ARCHITECTURE.md): comm imports nothing else of trident (the
flight recorder lives in it; `trident.deepspeed.comm`, deepspeed.comm's surface that
trident.comm re-exports, is on its layer), config never imports optim or trident.deepspeed
(optim registers its section rules, and trident.deepspeed.config DeepSpeed's dialect, with
config instead). Read from the source with `ast`, function-level imports included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import trident
from trident.config import ConfigError, load_config
from trident.config import loader

ROOT = Path(trident.__file__).parent


def trident_imports(package: str) -> dict[str, set[str]]:
    """file -> the trident modules it imports anywhere (top level or inside functions)."""
    out: dict[str, set[str]] = {}
    where = ROOT / package
    for path in [where] if where.is_file() else sorted(where.rglob("*.py")):
        module = ".".join(("trident",) + path.relative_to(ROOT).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level:
                names = [".".join(module.split(".")[:-node.level] + [node.module or ""]).rstrip(".")]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            out.setdefault(str(path.relative_to(ROOT)), set()).update(n for n in names if n.startswith("trident"))
    return out


def outside(package: str, allowed: tuple[str, ...]) -> dict[str, list[str]]:
    found = {f: sorted(n for n in names if not n.startswith(allowed)) for f, names in trident_imports(package).items()}
    return {f: names for f, names in found.items() if names}


COMM_LAYER = ("trident.comm", "trident.deepspeed.comm")


def test_comm_imports_only_comm():
    assert {**outside("comm", COMM_LAYER), **outside("deepspeed/comm.py", COMM_LAYER)} == {}


def test_config_does_not_import_optim():
    assert {f: names for f, names in trident_imports("config").items() if any("optim" in n.split(".") for n in names)} == {}


def test_config_does_not_import_deepspeed():
    assert {f: names for f, names in trident_imports("config").items()
            if any(n.startswith("trident.deepspeed") for n in names)} == {}


def test_deepspeed_config_imports_only_config():
    assert outside("deepspeed/config", ("trident.config", "trident.deepspeed.config")) == {}


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


def test_deepspeed_dialect_is_registered_by_importing_trident():
    from trident.config import dialect
    from trident.deepspeed.config import DEEPSPEED

    assert dialect.registered_dialect() is DEEPSPEED
    with pytest.raises(ConfigError, match=r"flops_profiler: \{\"enabled\": true\} asks for the FLOPs profiler"):
        load_config({"flops_profiler": {"enabled": True}})


def test_a_missing_dialect_is_loud_not_a_silent_skip(monkeypatch):
    from trident.config import dialect

    monkeypatch.setattr(dialect, "_registered", None)
    with pytest.raises(RuntimeError, match="no config dialect is registered"):
        load_config({})
