"""`trident verify CONFIG [--steps N] [--model SPEC]`: the config's layout against one process.

Runs the model for a few steps under the configured layout (on --nproc processes, started by
torchrun's agent as `trident launch` does) and, in rank 0's process, as a single process from
the same weights and batches; prints per-step loss, gradient norm and the largest parameter
difference, the max difference per named parameter, and on a mismatch the first module whose
output or gradient diverges.

--model MODULE:FUNCTION (or PATH.py:FUNCTION) names your factory: FUNCTION(config) returns
(model, dataset), where model(*batch) returns the loss and dataset[i] is one sample (batches
are built with torch's default collate). Without --model: trident's reference GPT from the
config's `model` section on its `data` section's text, as `trident train` uses.

Exit status: 0 when the runs agree, 1 on a mismatch, 2 when the run could not be set up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from trident.cli.args import positive_int
from trident.cli.launch import add_launch_arguments, launch
from trident.config import ConfigError, load_config


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("verify", help="check a parallel layout against one process",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_launch_arguments(p)
    p.set_defaults(nproc=None, no_slurm=True)  # one node: rank 0 reads the result file here
    p.add_argument("config", help="DeepSpeed-style JSON config (its layout is verified)")
    p.add_argument("--steps", type=positive_int, default=3, help="optimizer steps to compare (default 3)")
    p.add_argument("--model", default=None, metavar="SPEC",
                   help="MODULE:FUNCTION or PATH.py:FUNCTION returning (model, dataset)")
    p.add_argument("--rtol", type=positive_float, default=None,
                   help="relative tolerance (default 1e-4 in fp32, 2e-2 in bf16/fp16)")
    p.set_defaults(func=run)


def _check_model_spec(spec: str | None) -> str | None:
    """The problem with --model, or None."""
    if spec is None:
        return None
    module, sep, func = spec.rpartition(":")
    if not sep or not module or not func or not func.isidentifier():
        return (f"--model {spec!r}: expected MODULE:FUNCTION or PATH.py:FUNCTION "
                f"(e.g. my_project.models:make_model)")
    if module.endswith(".py") and not os.path.isfile(module):
        return f"--model {spec!r}: file {module} does not exist"
    return None


def run(args: argparse.Namespace) -> int:
    try:  # check once here, so a bad config is reported once, not by every rank
        cfg = load_config(args.config)
    except (ConfigError, OSError) as err:
        print(f"trident verify: {args.config}:\n{err}", file=sys.stderr)
        return 2
    problem = _check_model_spec(args.model)
    if problem:
        print(f"trident verify: {problem}", file=sys.stderr)
        return 2
    if args.nproc is None:
        args.nproc = 2 * cfg.tensor_parallel.size
    with tempfile.TemporaryDirectory(prefix="trident-verify-") as tmp:
        result = Path(tmp) / "result.json"
        target = ["trident.tools.verify", "--config", args.config, "--steps", str(args.steps),
                  "--result", str(result)]
        if args.model:
            target += ["--model", args.model]
        if args.rtol:
            target += ["--rtol", repr(args.rtol)]
        code = launch(args, target, module=True)
        if not result.exists():
            return code or 2
        verdict = json.loads(result.read_text())
    if verdict["error"]:
        return 2
    return 0 if verdict["ok"] else 1
