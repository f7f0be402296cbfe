"""Malformed configs, checkpoint files and command lines: one paragraph naming the problem each.

Table-driven. Every case runs a real entry point (the config loader, `trident checkpoint
consolidate`, `engine.load_checkpoint` on a one-rank gloo pool, the `trident` command line,
`trident verify`'s model loading) and checks that it fails with trident's own error (or a
command-line error and exit status), that the message contains the given text (which names
the offending key, file or argument), and that it is one paragraph: no traceback, no blank
line, at most 12 lines.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import shutil
import traceback
from pathlib import Path
from typing import Callable

import pytest
import torch

from trident.checkpointing.state import CheckpointError
from trident.cli import main as cli_main
from trident.cli import verify as verify_cli
from trident.config import ConfigError, load_config
from trident.tools.verify import VerifyError, _build, load_factory
from trident.testing.distributed import run_on_ranks

USER_ERRORS = (ConfigError, CheckpointError, VerifyError)


def outcome(call: Callable[[], object]) -> tuple[str, str]:
    """("user", message) for a clean failure, ("ok", output) when nothing failed, ("raw", traceback)."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = call()
    except USER_ERRORS as exc:
        return "user", str(exc) + err.getvalue()
    except SystemExit as exc:
        text = exc.code if isinstance(exc.code, str) else err.getvalue()
        return ("user" if exc.code not in (0, None) else "ok"), text
    except Exception:
        return "raw", traceback.format_exc()
    if isinstance(code, int) and code != 0:
        return "user", err.getvalue()
    return "ok", out.getvalue() + err.getvalue()


def assert_one_paragraph(kind: str, text: str, expected: str) -> None:
    assert kind == "user", f"expected a clean error, got {kind}:\n{text}"
    assert "Traceback" not in text, text
    assert expected in text, f"{expected!r} not in:\n{text}"
    lines = text.strip().splitlines()
    assert len(lines) <= 12 and all(line.strip() for line in lines), f"not one paragraph:\n{text}"


# -- configs ------------------------------------------------------------------------------

CONFIGS = [
    ({"distributed": {"timeout_s": 0}}, "distributed.timeout_s: expected a positive number, got 0"),
    ({"distributed": {"timeout_s": "fast"}}, "distributed.timeout_s: expected a positive number, got 'fast'"),
    ({"distributed": {"timeout_s": True}}, "distributed.timeout_s: expected a positive number, got true"),
    ({"distributed": {"timeout_s": float("nan")}}, "distributed.timeout_s: expected a positive number, got NaN"),
    ({"distributed": {"timeout_s": float("inf")}}, "distributed.timeout_s: expected a positive number, got Infinity"),
    ({"distributed": {"hang_detector": "yes"}}, "distributed.hang_detector: expected true or false, got 'yes'"),
    ({"distributed": {"flight_recorder_size": 0}}, "distributed.flight_recorder_size: expected a positive integer"),
    ({"distributed": {"flight_recorder_size": 2.5}}, "distributed.flight_recorder_size: expected a positive integer"),
    ({"distributed": {"strict_collectives": 1}}, "distributed.strict_collectives: expected true or false, got 1"),
    ({"distributed": {"timeout": 5}}, "distributed.timeout: unknown key; did you mean 'timeout_s'?"),
    ({"distributed": []}, "distributed: expected an object ({...}), got []"),
    ({"checkpoint": {"save_interval": -1}}, "checkpoint.save_interval: expected a non-negative integer, got -1"),
    ({"checkpoint": {"keep_last": "2"}}, "checkpoint.keep_last: expected a non-negative integer, got '2'"),
    ({"checkpoint": {"auto_resume": "true"}}, "checkpoint.auto_resume: expected true or false, got 'true'"),
    ({"checkpoint": {"path": 5}}, "checkpoint.path: expected a string or null, got 5"),
    ({"checkpoint": {"auto_resum": True}}, "checkpoint.auto_resum: unknown key; did you mean 'auto_resume'?"),
    ({"checkpoint": None}, "checkpoint: expected an object ({...}), got null"),
    ({"numerics": {"on_nonfinite": "ignore"}}, "numerics.on_nonfinite: expected one of 'stop', 'skip', got 'ignore'"),
    ({"numerics": "stop"}, "numerics: expected an object ({...}), got 'stop'"),
    ({"tensor_parallel": {"size": 0}}, "tensor_parallel.size: expected a positive integer, got 0"),
    ({"pipeline": {"stages": -1}}, "pipeline.stages: expected a positive integer, got -1"),
    ({"pipeline": {"schedule": "bogus"}}, "pipeline.schedule: expected one of 'gpipe', '1f1b'"),
    ({"zero_optimization": {"stage": "two"}}, "zero_optimization.stage: expected an integer, got 'two'"),
    ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu: expected a positive integer"),
    ({"gradient_accumulation_steps": 1.5}, "gradient_accumulation_steps: expected a positive integer"),
    ({"optimizer": {"type": "SGD", "params": {"lr": float("nan")}}},
     "optimizer.params.lr: expected a non-negative number"),
    ({"seed": "abc"}, "seed: expected an integer, got 'abc'"),
    ({"steps_per_print": -1}, "steps_per_print: expected a non-negative integer or null, got -1"),
    ({"model": {"preset": "huge"}}, "model.preset: unknown preset 'huge'"),
]

CONFIG_FILES = [
    ("", "invalid JSON at line 1, column 1"),
    ('{"train_micro_batch_size_per_gpu": 2,}', "invalid JSON at line 1, column 38"),
    ("[1, 2]", "expected a JSON object {...} at the top, got [1, 2]"),
    (b"\xff\xfe\x00", "cannot read the config file"),
]


@pytest.mark.parametrize("config,expected", CONFIGS)
def test_malformed_config(config, expected):
    assert_one_paragraph(*outcome(lambda: load_config(config)), expected)


@pytest.mark.parametrize("content,expected", CONFIG_FILES)
def test_malformed_config_file(tmp_path, content, expected):
    path = tmp_path / "config.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    kind, text = outcome(lambda: cli_main.main(["config", "check", str(path)]))
    assert_one_paragraph(kind, text, expected)
    assert str(path) in text


# -- checkpoint files, through two entry points ------------------------------------------------

def save_base_checkpoint(folder: str) -> None:
    import trident
    from trident.models.toy import TinyMLP
    from trident.testing.distributed import cached_mesh

    torch.manual_seed(0)
    engine, *_ = trident.initialize(model=TinyMLP(), mesh=cached_mesh(), config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 0, "optimizer": {"type": "AdamW", "params": {}}})
    x = torch.randn(2, 16)
    engine.backward(engine(x, x))
    engine.step()
    engine.save_checkpoint(folder)


def load_into_engine(folder: str) -> tuple[str, str]:
    import trident
    from trident.models.toy import TinyMLP
    from trident.testing.distributed import cached_mesh

    engine, *_ = trident.initialize(model=TinyMLP(), mesh=cached_mesh(), config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 0, "optimizer": {"type": "AdamW", "params": {}}})
    return outcome(lambda: engine.load_checkpoint(folder))


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("ckpt") / "run"
    run_on_ranks(1, save_base_checkpoint, str(folder))
    return folder


def _manifest(tag: Path, change: Callable[[dict], object]) -> None:
    data = json.loads((tag / "manifest.json").read_text())
    change(data)
    (tag / "manifest.json").write_text(json.dumps(data))


def _replace(tag: Path, name: str, content: bytes) -> None:
    """Overwrite a file and fix its checksum in the manifest, so only the content is wrong."""
    (tag / name).write_bytes(content)
    _manifest(tag, lambda m: m["files"][name].update(sha256=hashlib.sha256(content).hexdigest()))


def _cases() -> list:
    """CHECKPOINTS as pytest params named by their first field."""
    return [pytest.param(*case, id=case[0]) for case in CHECKPOINTS]


CHECKPOINTS = [
    ("latest names a missing tag", lambda root, tag: (root / "latest").write_text("global_step9"), "global_step9"),
    ("manifest missing", lambda root, tag: (tag / "manifest.json").unlink(), "manifest.json: missing"),
    ("model file missing", lambda root, tag: (tag / "model.safetensors").unlink(), "model.safetensors: file missing"),
    ("model file corrupt", lambda root, tag: (tag / "model.safetensors").write_bytes(b"x" * 64),
     "model.safetensors: checksum mismatch"),
    ("optimizer file corrupt", lambda root, tag: (tag / "optim_pp0_tp0.pt").write_bytes(b"x"),
     "optim_pp0_tp0.pt: checksum mismatch"),
    ("manifest not JSON", lambda root, tag: (tag / "manifest.json").write_text("{not json"),
     "manifest.json: unreadable"),
    ("manifest is a list", lambda root, tag: (tag / "manifest.json").write_text("[]"), "manifest.json"),
    ("manifest without files", lambda root, tag: _manifest(tag, lambda m: m.pop("files")), "files"),
    ("manifest without layout", lambda root, tag: _manifest(tag, lambda m: m.pop("layout")), "layout"),
    ("model file not safetensors", lambda root, tag: _replace(tag, "model.safetensors", b"garbage"),
     "model.safetensors"),
    ("manifest from a newer trident", lambda root, tag: _manifest(tag, lambda m: m.update(format_version=99)),
     "format_version"),
]


def _broken_copy(base: Path, tmp_path: Path, damage) -> Path:
    root = tmp_path / "run"
    shutil.copytree(base, root)
    damage(root, root / "global_step1")
    return root


@pytest.mark.parametrize("name,damage,expected", _cases())
def test_malformed_checkpoint_consolidate(base_checkpoint, tmp_path, name, damage, expected):
    from trident.checkpointing.consolidate import consolidate

    root = _broken_copy(base_checkpoint, tmp_path, damage)
    assert_one_paragraph(*outcome(lambda: consolidate(str(root), str(tmp_path / "out.safetensors"))), expected)


@pytest.mark.parametrize("name,damage,expected", _cases())
def test_malformed_checkpoint_load(base_checkpoint, tmp_path, name, damage, expected):
    root = _broken_copy(base_checkpoint, tmp_path, damage)
    (kind, text), = run_on_ranks(1, load_into_engine, str(root))
    assert_one_paragraph(kind, text, expected)


# -- command lines --------------------------------------------------------------------------

def _verify_main(argv: list[str]) -> int:
    """`trident verify ...` through its own parser (it is registered in trident.cli.main too)."""
    parser = argparse.ArgumentParser(prog="trident")
    verify_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


COMMAND_LINES = [
    (["launch", "--nproc", "0", "x.py"], "--nproc must be >= 1, got 0"),
    (["launch", "--nproc", "two", "x.py"], "argument --nproc: invalid int value: 'two'"),
    (["launch", "--nnodes", "0", "x.py"], "--nnodes must be >= 1, got 0"),
    (["launch", "--nnodes", "2", "--node-rank", "2", "x.py"], "--node-rank must be in 0..1 for --nnodes 2, got 2"),
    (["launch", "--max-restarts", "-1", "x.py"], "--max-restarts must be >= 0, got -1"),
    (["launch", "--master-port", "70000", "x.py"], "--master-port must be in 1..65535, got 70000"),
    (["launch", "missing_script.py"], "script 'missing_script.py' does not exist"),
    (["launch", "-m", "no_such_module_xyz"], "no module named 'no_such_module_xyz'"),
    (["launch"], "the following arguments are required: script"),
    (["train", "--steps", "0"], "argument --steps: expected a positive integer, got '0'"),
    (["train", "--config", "no_such_config.json"], "no_such_config.json"),
    (["config", "check", "cfg.json", "--world-size", "-2"], "argument --world-size: expected a positive integer"),
    (["checkpoint", "consolidate", "no_such_dir", "out.safetensors"], "no_such_dir: no checkpoint here"),
    (["frobnicate"], "argument COMMAND: invalid choice: 'frobnicate'"),
]

VERIFY_LINES = [
    (["verify", "no_such_config.json"], "no_such_config.json"),
    (["verify", "{cfg}", "--steps", "0"], "argument --steps: expected a positive integer, got '0'"),
    (["verify", "{cfg}", "--model", "nocolon"], "--model 'nocolon': expected MODULE:FUNCTION or PATH.py:FUNCTION"),
    (["verify", "{cfg}", "--model", "missing.py:make"], "--model 'missing.py:make': file missing.py does not exist"),
    (["verify", "{cfg}", "--rtol", "0"], "argument --rtol: expected a positive number, got '0'"),
    (["verify", "{cfg}", "--rtol", "tight"], "argument --rtol: expected a positive number, got 'tight'"),
]


@pytest.mark.parametrize("argv,expected", COMMAND_LINES)
def test_malformed_command_line(argv, expected):
    assert_one_paragraph(*outcome(lambda: cli_main.main(argv)), expected)


@pytest.mark.parametrize("argv,expected", VERIFY_LINES)
def test_malformed_verify_command_line(tmp_path, argv, expected):
    cfg = tmp_path / "cfg.json"
    cfg.write_text('{"train_micro_batch_size_per_gpu": 2}')
    argv = [a.replace("{cfg}", str(cfg)) for a in argv]
    assert_one_paragraph(*outcome(lambda: _verify_main(argv)), expected)


# -- `trident verify`'s model factories ----------------------------------------------------

def _factory_module(tmp_path: Path, body: str) -> str:
    path = tmp_path / "factories.py"
    path.write_text(body)
    return str(path)


FACTORIES = [
    ("raise ImportError('no torchvision here')\n", "make",
     "importing {path} failed with ImportError: no torchvision here"),
    ("x = 1\n", "make", "has no function 'make'; it must define make(config) returning (model, dataset)"),
    ("def make(config):\n    return None\n", "make",
     "the model factory returned NoneType; it must return (model, dataset)"),
    ("def make(config):\n    return 'model', [1]\n", "make", "the model factory returned str as the model"),
    ("import torch\ndef make(config):\n    return torch.nn.Linear(2, 2), []\n", "make",
     "the model factory's dataset must be a non-empty map-style dataset"),
]


@pytest.mark.parametrize("body,func,expected", FACTORIES)
def test_malformed_model_factory(tmp_path, body, func, expected):
    path = _factory_module(tmp_path, body)
    cfg = load_config({"train_micro_batch_size_per_gpu": 2})
    kind, text = outcome(lambda: _build(load_factory(f"{path}:{func}"), cfg))
    assert_one_paragraph(kind, text, expected.format(path=path))
