"""`trident train`: the built-in GPT trainer on N processes, launched by torchrun's agent.

Without --config it trains the demo GPT on the bundled corpus with trident/configs/demo.json.
"""

from __future__ import annotations

import argparse
import sys

from trident.cli.args import positive_int
from trident.cli.launch import add_host_arguments, add_launch_arguments, launch
from trident.config import ConfigError, load_config
from trident.trainer import DEFAULT_CONFIG



def add_parser(subparsers) -> None:
    p = subparsers.add_parser("train", help="train the reference GPT on N processes",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_launch_arguments(p)
    add_host_arguments(p)
    p.set_defaults(default_nproc=2)  # without --nproc, a hostfile or SLURM: two ranks
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="DeepSpeed-style JSON config")
    p.add_argument("--steps", type=positive_int, default=None, help="override trainer.train_steps")
    p.add_argument("--run-dir", default=None, help="override trainer.run_dir")
    p.add_argument("--run-name", default=None, help="override trainer.run_name")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:  # check once here, so a bad config is reported once, not by every rank
        load_config(args.config)
    except (ConfigError, OSError) as err:
        print(f"trident train: {args.config}:\n{err}", file=sys.stderr)
        return 1
    target = ["trident.trainer", "--config", args.config]
    for flag, value in (("--steps", args.steps), ("--run-dir", args.run_dir), ("--run-name", args.run_name)):
        if value is not None:
            target += [flag, str(value)]
    return launch(args, target, module=True)
