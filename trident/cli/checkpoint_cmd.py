"""`trident checkpoint inspect | reshard | consolidate | merge-lora`: work with a checkpoint on
disk, with no process group.

CKPT_DIR is the folder given to `engine.save_checkpoint` (its `latest` tag is used unless
--tag is given) or one checkpoint folder.

  inspect CKPT_DIR                          the layout, every tensor (global shape, dtype, how
                                            it is split) and every file with its size
  reshard CKPT_DIR OUT --pp P --tp T --dp D  write the checkpoint for another layout
  consolidate CKPT_DIR OUT                  one plain fp32 state dict: OUT is a file
                                            (.safetensors, or .pt/.bin for torch.save) or a
                                            folder (model_fp32.safetensors inside); it loads
                                            into the unsplit model with `load_state_dict`
  merge-lora CKPT_DIR OUT                   a LoRA checkpoint's adapters folded into their base
                                            weights (W + alpha / r * B A, alpha and r from the
                                            manifest): OUT/model.safetensors loads into the
                                            model as it was before `apply_lora`
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
    i = sub.add_parser("inspect", help="print a checkpoint's layout, tensors and files",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    i.add_argument("checkpoint_dir", metavar="CKPT_DIR", help="save_checkpoint's folder, or one tag folder")
    i.add_argument("--tag", default=None, help="checkpoint tag (default: the one named in 'latest')")
    i.add_argument("--verify", action="store_true", help="also check every file's sha256 against the manifest")
    i.set_defaults(func=run_inspect)
    r = sub.add_parser("reshard", help="write a checkpoint for another (pp, dp, tp) layout",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("checkpoint_dir", metavar="CKPT_DIR", help="save_checkpoint's folder, or one tag folder")
    r.add_argument("out", metavar="OUT", help="new checkpoint folder (must not exist or be empty)")
    for flag in ("--pp", "--tp", "--dp"):
        r.add_argument(flag, type=int, required=True, help=f"{flag[2:]} size of the new layout")
    r.add_argument("--tag", default=None, help="checkpoint tag (default: the one named in 'latest')")
    r.set_defaults(func=run_reshard)
    m = sub.add_parser("merge-lora", help="write the model with its LoRA adapters merged into the weights",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m.add_argument("checkpoint_dir", metavar="CKPT_DIR", help="save_checkpoint's folder, or one tag folder")
    m.add_argument("out", metavar="OUT", help="output folder (model.safetensors is written inside)")
    m.add_argument("--tag", default=None, help="checkpoint tag (default: the one named in 'latest')")
    m.add_argument("--scaling", type=float, default=None,
                   help="alpha / r, for a checkpoint whose manifest does not record them (default: the manifest's)")
    m.set_defaults(func=run_merge_lora)
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


def run_inspect(args: argparse.Namespace) -> int:
    from trident.checkpointing.consolidate import checkpoint_folder
    from trident.checkpointing.inspect import describe
    from trident.checkpointing.state import CheckpointError

    try:
        print(describe(checkpoint_folder(args.checkpoint_dir, args.tag), verify=args.verify))
    except CheckpointError as err:
        print(f"trident checkpoint inspect: {err}", file=sys.stderr)
        return 1
    return 0


def run_reshard(args: argparse.Namespace) -> int:
    from trident.checkpointing.consolidate import checkpoint_folder
    from trident.checkpointing.reshard import reshard
    from trident.checkpointing.state import CheckpointError

    try:
        out = reshard(checkpoint_folder(args.checkpoint_dir, args.tag), args.out, pp=args.pp, tp=args.tp, dp=args.dp)
    except (CheckpointError, ValueError) as err:
        print(f"trident checkpoint reshard: {err}", file=sys.stderr)
        return 1
    print(out)
    return 0


def run_merge_lora(args: argparse.Namespace) -> int:
    from trident.checkpointing.state import CheckpointError
    from trident.peft.merge import merge_lora_checkpoint

    try:
        _, summary = merge_lora_checkpoint(args.checkpoint_dir, args.out, tag=args.tag, scaling=args.scaling)
    except (CheckpointError, ValueError) as err:
        print(f"trident checkpoint merge-lora: {err}", file=sys.stderr)
        return 1
    print(summary)
    return 0
