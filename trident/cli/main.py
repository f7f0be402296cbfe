"""The `trident` command: one subcommand per module in trident/cli/."""

from __future__ import annotations

import argparse
import os
import sys

import trident.cli.checkpoint_cmd as checkpoint_cmd
import trident.cli.config_check as config_check
import trident.cli.data_cmd as data_cmd
import trident.cli.doctor as doctor
import trident.cli.launch as launch
import trident.cli.pipeline_cmd as pipeline_cmd
import trident.cli.plan as plan
import trident.cli.train as train
import trident.cli.verify as verify


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trident", description="Parallel training on torch.distributed.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    launch.add_parser(sub)
    train.add_parser(sub)
    verify.add_parser(sub)
    plan.add_parser(sub)
    pipeline_cmd.add_parser(sub)
    config = sub.add_parser("config", help="inspect configs")
    config_check.add_parser(config.add_subparsers(dest="config_command", metavar="SUBCOMMAND"))
    checkpoint_cmd.add_parser(sub)
    data_cmd.add_parser(sub)
    doctor.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a SLURM fan-out repeats on every node
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return func(args)
    except BrokenPipeError:  # `trident checkpoint inspect DIR | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
