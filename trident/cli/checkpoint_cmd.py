"""`trident checkpoint consolidate CKPT_DIR OUT [--tag TAG]`: one plain fp32 state dict from a
checkpoint, with no process group (reads every rank's partition from disk).

CKPT_DIR is the folder given to `engine.save_checkpoint` (its `latest` tag is used unless
--tag is given) or one checkpoint folder. OUT is a file (.safetensors, or .pt/.bin for
torch.save) or a folder (model_fp32.safetensors inside). The result loads into the unsplit
model with `model.load_state_dict`.
"""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `trident checkpoint ...`."""
    p = subparsers.add_parser("checkpoint", help="work with saved checkpoints")
    sub = p.add_subparsers(dest="checkpoint_command", metavar="SUBCOMMAND")
    c = sub.add_parser("consolidate", help="write one fp32 state dict from a (ZeRO) checkpoint",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("checkpoint_dir", metavar="CKPT_DIR", help="save_checkpoint's folder, or one tag folder")
    c.add_argument("out", metavar="OUT", help="output file (.safetensors, .pt, .bin) or folder")
    c.add_argument("--tag", default=None, help="checkpoint tag (default: the one named in 'latest')")
    c.set_defaults(func=run_consolidate)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
    return p


def run_consolidate(args: argparse.Namespace) -> int:
    from trident.checkpointing.consolidate import consolidate
    from trident.checkpointing.state import CheckpointError

    try:
        out = consolidate(args.checkpoint_dir, args.out, tag=args.tag)
    except CheckpointError as err:
        print(f"trident checkpoint consolidate: {err}", file=sys.stderr)
        return 1
    print(out)
    return 0
