"""`trident config check FILE [--world-size N] [--strict]`: validate a config and print it resolved.

On success the resolved config (every default filled in) goes to stdout as JSON, so it can be
saved or piped; with --world-size the batch sizes in it are resolved for that many
data-parallel ranks and the batch arithmetic is printed to stderr. On failure every problem is
printed to stderr with its JSON path, and the exit status is 1. DeepSpeed keys that have no
effect here and unknown top-level keys are listed on stderr; --strict makes unknown keys errors.
"""

from __future__ import annotations

import argparse
import json
import sys

from trident.cli.args import positive_int
from trident.config import ConfigError, batch_issues, load_config, resolve_batch
from trident.deepspeed.config import startup_lines



def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `check` on the subparsers of `trident config`."""
    p = subparsers.add_parser("check", help="validate a config and print it resolved",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", help="DeepSpeed-style JSON config")
    p.add_argument("--world-size", type=positive_int, default=None,
                   help="data-parallel ranks to resolve the batch sizes for")
    p.add_argument("--strict", action="store_true",
                   help="unknown keys (and comment keys) are errors, as with \"strict\": true in the file")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Print the resolved config and return 0, or print every error and return 1."""
    try:
        cfg = load_config(args.file, strict=getattr(args, "strict", False))
        issues = batch_issues(cfg, args.world_size)
        if issues:
            raise ConfigError(issues)
    except ConfigError as err:
        print(f"{args.file}: {len(err.issues)} problem{'s' if len(err.issues) != 1 else ''}:\n{err}", file=sys.stderr)
        return 1
    if cfg.parameter_server.servers > 0:
        from trident.parameter_server.layout import check_supported
        try:
            check_supported(cfg)
        except ValueError as err:
            print(f"{args.file}: {err}", file=sys.stderr)
            return 1
    for line in startup_lines(list(cfg._notes)):
        print(line, file=sys.stderr)
    resolved = cfg.to_dict()
    if args.world_size is not None:
        batch = resolve_batch(cfg, args.world_size)
        resolved.update(train_batch_size=batch.train_batch_size,
                        train_micro_batch_size_per_gpu=batch.micro_batch_size,
                        gradient_accumulation_steps=batch.gradient_accumulation_steps)
        print(f"batch: {batch.describe(args.world_size)}", file=sys.stderr)
    print(json.dumps(resolved, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run standalone: `python -m trident.cli.config_check check FILE [--world-size N]`."""
    parser = argparse.ArgumentParser(prog="trident config")
    add_parser(parser.add_subparsers(dest="config_command", metavar="SUBCOMMAND", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
