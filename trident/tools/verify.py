"""`trident verify`: the configured layout against one process, step by step and module by module.

Every rank builds the user's model (same seed, so the same weights) and trains it for a few
steps under the config's layout, on a fixed sequence of global batches. Rank 0 also trains a
second copy as a single process: the same config with no tensor parallelism, ZeRO stage 0
and every micro-batch of the global batch accumulated on one rank. With exact arithmetic
both runs compute the same thing, so any difference beyond rounding is a bug.

What is compared, per step: the loss (averaged over the data-parallel ranks), the global
gradient norm, and every named parameter after the optimizer step (max absolute difference).
Forward hooks record every module's output on every micro-batch, and a hook on that output
records the gradient flowing back into it. At the first step where anything differs, the
report names the first module (in execution order) whose output differs; if every output
matches, the first module whose output gradient differs (in backward order); if those match
too, the module owning the first parameter whose update differs (its parameter gradient).

Micro-batch m of step s is samples [s*G + m*micro, s*G + (m+1)*micro) of the data (G = the
global batch); data-parallel rank r runs micro-batches r*gas .. r*gas + gas - 1. The RNG is
reseeded per (step, micro-batch), so dropout draws the same masks in both runs.
Not supported: pipeline.stages > 1 and parameter servers.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from trident.comm import collectives
from trident.comm.backend import init_distributed
from trident.config import ConfigError, TridentConfig, load_config, resolve_batch
from trident.config.monitor_sections import MONITOR_SECTIONS
from trident.engine.build import initialize
from trident.parallel.mesh import ParallelMesh
from trident.tools.verify_compare import compare, default_rtol, report
from trident.tools.verify_record import RunRecord, record_run

Factory = Callable[[TridentConfig], tuple]


class VerifyError(ValueError):
    """The model factory, the data or the config cannot be verified; the message says why."""


# -- the user's model and data ---------------------------------------------------------------

def load_factory(spec: str | None) -> Factory:
    """`module:function` or `path/to/file.py:function` -> the factory; None -> the reference GPT."""
    if spec is None:
        return reference_gpt
    module_name, sep, func_name = spec.rpartition(":")
    if not sep or not module_name or not func_name:
        raise VerifyError(f"--model {spec!r}: expected MODULE:FUNCTION or PATH.py:FUNCTION, e.g. "
                          f"my_project.models:make_model")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise VerifyError(f"--model {spec!r}: file {module_name} does not exist")
            loader = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except VerifyError:
        raise
    except Exception as err:  # the user's module failed to import: say which and why, in one line
        raise VerifyError(f"--model {spec!r}: importing {module_name} failed with "
                          f"{type(err).__name__}: {err}") from None
    factory = getattr(module, func_name, None)
    if not callable(factory):
        raise VerifyError(f"--model {spec!r}: {module_name} has no function {func_name!r}; it must define "
                          f"{func_name}(config) returning (model, dataset)")
    return factory


def reference_gpt(cfg: TridentConfig) -> tuple:
    """trident's GPT from the config's `model` section, on the `data` section's text."""
    from trident.data.datasets import load_text_dataset
    from trident.data.tokenizer import load_tokenizer
    from trident.models.gpt import GPT
    from trident.trainer import gpt_config

    model_cfg = gpt_config(cfg, load_tokenizer(cfg.data.tokenizer).get_vocab_size())
    dataset = load_text_dataset(model_cfg.seq_len, path=None if cfg.data.dataset == "kjv" else cfg.data.dataset,
                                tokenizer_path=cfg.data.tokenizer, val_fraction=cfg.data.val_fraction)
    return GPT(model_cfg), dataset


def _build(factory: Factory, cfg: TridentConfig) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(cfg.seed)
    made = factory(cfg)
    if not (isinstance(made, tuple) and len(made) == 2):
        raise VerifyError(f"the model factory returned {type(made).__name__}; it must return (model, dataset)")
    model, data = made
    if not isinstance(model, torch.nn.Module):
        raise VerifyError(f"the model factory returned {type(model).__name__} as the model; expected a torch.nn.Module")
    if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")) or len(data) == 0:
        raise VerifyError("the model factory's dataset must be a non-empty map-style dataset (len() and [i]); "
                          f"got {type(data).__name__}")
    return model, data


# -- the two runs ---------------------------------------------------------------------------

def _serial_config(cfg: TridentConfig, global_batch: int, micro: int) -> TridentConfig:
    return cfg.model_copy(update={
        "train_batch_size": global_batch, "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": global_batch // micro,
        "tensor_parallel": cfg.tensor_parallel.model_copy(update={"size": 1, "sequence_parallel": False, "plan": None}),
        "zero_optimization": cfg.zero_optimization.model_copy(update={"stage": 0}),
        **_quiet_sections(cfg)})


def _quiet_sections(cfg: TridentConfig) -> dict:
    """verify writes nothing: no checkpoints, no resume, no monitors."""
    return {"checkpoint": cfg.checkpoint.model_copy(update={"path": None, "auto_resume": False}),
            **{key: getattr(cfg, key).model_copy(update={"enabled": False}) for key in MONITOR_SECTIONS},
            "steps_per_print": 0}


def run_both(cfg: TridentConfig, factory: Factory, steps: int) -> tuple[RunRecord | None, RunRecord, ParallelMesh]:
    """(serial record on rank 0 else None, this rank's parallel record, the parallel mesh)."""
    if cfg.pipeline.stages > 1 or cfg.parameter_server.servers > 0:
        raise VerifyError("trident verify supports data, tensor and ZeRO parallelism; pipeline.stages > 1 and "
                          "parameter servers are not supported yet: verify with pipeline.stages = 1")
    mesh = ParallelMesh.build(pp=1, tp=cfg.tensor_parallel.size)
    solo = ParallelMesh.solo()
    batch = resolve_batch(cfg, mesh.dp_size)
    micro, gas = batch.micro_batch_size, batch.gradient_accumulation_steps
    global_batch = batch.train_batch_size
    serial = None
    if dist.get_rank() == 0:
        model, data = _build(factory, cfg)
        engine, *_ = initialize(model=model, config=_serial_config(cfg, global_batch, micro), mesh=solo)
        serial = record_run(engine, data, steps, lambda s: list(range(global_batch // micro)), micro, global_batch,
                            cfg.seed)
        del engine
    collectives.barrier(group=mesh.mesh_group)
    model, data = _build(factory, cfg)
    engine, *_ = initialize(model=model, config=cfg.model_copy(update=_quiet_sections(cfg)), mesh=mesh)
    mine = [mesh.dp_rank * gas + k for k in range(gas)]
    parallel = record_run(engine, data, steps, lambda s: mine, micro, global_batch, cfg.seed)
    losses = torch.tensor(parallel.losses, dtype=torch.float64)
    collectives.all_reduce(losses, group=mesh.dp_group)
    parallel.losses = (losses / mesh.dp_size).tolist()
    return serial, parallel, mesh


def verify(cfg: TridentConfig, factory: Factory, steps: int, rtol: float | None = None) -> tuple[str, bool]:
    """Run both, compare on every rank, gather on every rank: (report, whether the runs agree).

    Collective over the world. `rtol` defaults by precision (verify_compare.default_rtol).
    """
    serial, parallel, mesh = run_both(cfg, factory, steps)
    box = [serial]
    collectives.broadcast_object_list(box, src=0, group=mesh.mesh_group)
    serial = box[0]
    dtype = torch.bfloat16 if cfg.bf16.enabled else torch.float16 if cfg.fp16.enabled else torch.float32
    rtol = default_rtol(dtype) if rtol is None else rtol
    summaries: list = [None] * mesh.world_size
    collectives.all_gather_object(summaries, compare(parallel, serial, dist.get_rank(), rtol), group=mesh.mesh_group)
    layout = (f"pp 1 x dp {mesh.dp_size} x tp {mesh.tp_size}, ZeRO stage {cfg.zero_optimization.stage}, "
              f"{str(dtype).replace('torch.', '')}")
    return report(parallel, serial, summaries, layout, rtol)


def main(argv: list[str] | None = None) -> int:
    """Worker entry of `trident verify` (python -m trident.tools.verify, under torchrun).

    Rank 0 prints the report and writes {"ok": bool, "error": str | None} to --result.
    """
    parser = argparse.ArgumentParser(prog="python -m trident.tools.verify")
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--model", default=None)
    parser.add_argument("--rtol", type=float, default=None)
    parser.add_argument("--result", default=None)
    args = parser.parse_args(argv)
    cfg = load_config(args.config)
    init_distributed(timeout_s=cfg.distributed.timeout_s)
    error, text, ok = None, "", False
    try:
        text, ok = verify(cfg, load_factory(args.model), args.steps, args.rtol)
    except (VerifyError, ConfigError) as err:
        error = str(err)
    if dist.get_rank() == 0:
        if error is not None:
            print(f"trident verify: {error}", file=sys.stderr)
        else:
            print(text, flush=True)
        if args.result:
            Path(args.result).write_text(json.dumps({"ok": ok, "error": error}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
