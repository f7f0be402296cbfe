"""`trident checkpoint inspect | reshard | consolidate | merge-lora | export-hf | import-deepspeed`: work with
a checkpoint on disk, with no process group.

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
  export-hf CKPT_DIR OUT                    the model as transformers' from_pretrained reads it:
                                            OUT/config.json and safetensors shards with their
                                            index (any layout; the manifest records the config,
                                            else give --config)
  import-deepspeed DS_DIR OUT               a DeepSpeed ZeRO 0-3 or pipeline checkpoint (its
                                            save_checkpoint folder or one tag folder) as a
                                            trident checkpoint under OUT (OUT/<tag>, OUT/latest)
                                            that loads under any layout; DeepSpeed is not needed
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile


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
    d = sub.add_parser("import-deepspeed", help="convert a DeepSpeed checkpoint into a trident checkpoint",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d.add_argument("ds_dir", metavar="DS_DIR", help="DeepSpeed's save_checkpoint folder, or one tag folder")
    d.add_argument("out", metavar="OUT", help="new folder for the trident checkpoint (must not exist or be empty)")
    d.add_argument("--tag", default=None, help="DeepSpeed tag (default: the one named in 'latest')")
    d.set_defaults(func=run_import_deepspeed)
    h = sub.add_parser("export-hf", help="write the checkpoint as a transformers from_pretrained folder",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    h.add_argument("checkpoint_dir", metavar="CKPT_DIR", help="save_checkpoint's folder, or one tag folder")
    h.add_argument("out", metavar="OUT", help="output folder (config.json and safetensors shards)")
    h.add_argument("--tag", default=None, help="checkpoint tag (default: the one named in 'latest')")
    h.add_argument("--config", default=None,
                   help="transformers config.json (or its folder), when the manifest records none")
    h.add_argument("--max-shard-size", default="5GB", help="largest weight file (default 5GB)")
    h.add_argument("--dtype", default=None, help="dtype of the floating tensors (default: the model's)")
    h.set_defaults(func=run_export_hf)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
    return p


def _run(verb: str, action) -> int:
    """Run one subcommand: print what `action()` returns (to stdout: a folder, a summary), or
    its CheckpointError / ValueError as one line on stderr with exit code 1."""
    from trident.checkpointing.state import CheckpointError

    try:
        text = action()
    except (CheckpointError, ValueError) as err:
        print(f"trident checkpoint {verb}: {err}", file=sys.stderr)
        return 1
    print(text)
    return 0


def run_export_hf(args: argparse.Namespace) -> int:
    from trident.hf.export import export_checkpoint
    return _run("export-hf", lambda: export_checkpoint(args.checkpoint_dir, args.out, tag=args.tag,
                                                       config=args.config, max_shard_size=args.max_shard_size,
                                                       dtype=args.dtype))


def run_import_deepspeed(args: argparse.Namespace) -> int:
    from trident.deepspeed.checkpoint import import_deepspeed, read_deepspeed

    def action() -> str:
        folder = import_deepspeed(args.ds_dir, args.out, tag=args.tag)
        ds = read_deepspeed(args.ds_dir, args.tag)
        print(f"imported DeepSpeed {ds.version} {ds.layout['kind']} checkpoint (dp {ds.layout['dp']}, pp "
              f"{ds.layout['pp']}), step {ds.counters['global_steps']}, {len(ds.params)} parameters: {folder}",
              file=sys.stderr)
        return folder
    return _run("import-deepspeed", action)


@contextlib.contextmanager
def _trident_view(checkpoint_dir: str, tag: str | None):
    """(folder, tag) to read: `checkpoint_dir` itself, or, for a DeepSpeed checkpoint, its import
    into a temporary folder (read in place; `import-deepspeed` keeps a converted copy)."""
    from trident.deepspeed.checkpoint import import_deepspeed, is_deepspeed_checkpoint

    if not is_deepspeed_checkpoint(checkpoint_dir, tag):
        yield checkpoint_dir, tag
        return
    with tempfile.TemporaryDirectory(prefix="trident-ds-read-") as tmp:
        folder = import_deepspeed(checkpoint_dir, f"{tmp}/ckpt", tag=tag)
        print(f"{checkpoint_dir}: a DeepSpeed checkpoint, read through `trident checkpoint import-deepspeed` "
              "(run it to keep a trident copy)", file=sys.stderr)
        yield str(folder.parent), folder.name


def run_consolidate(args: argparse.Namespace) -> int:
    from trident.checkpointing.consolidate import consolidate

    def action():
        with _trident_view(args.checkpoint_dir, args.tag) as (folder, tag):
            return consolidate(folder, args.out, tag=tag)
    return _run("consolidate", action)


def run_inspect(args: argparse.Namespace) -> int:
    from trident.checkpointing.consolidate import checkpoint_folder
    from trident.checkpointing.inspect import describe

    def action():
        with _trident_view(args.checkpoint_dir, args.tag) as (folder, tag):
            path = checkpoint_folder(folder, tag)
            text = describe(path, verify=args.verify)
            return text if folder == args.checkpoint_dir else text.replace(
                f"checkpoint {path}", f"DeepSpeed checkpoint {args.checkpoint_dir} ({tag})", 1)
    return _run("inspect", action)


def run_reshard(args: argparse.Namespace) -> int:
    from trident.checkpointing.consolidate import checkpoint_folder
    from trident.checkpointing.reshard import reshard
    return _run("reshard", lambda: reshard(checkpoint_folder(args.checkpoint_dir, args.tag), args.out,
                                           pp=args.pp, tp=args.tp, dp=args.dp))


def run_merge_lora(args: argparse.Namespace) -> int:
    from trident.checkpointing.lora import merge_lora_checkpoint
    return _run("merge-lora", lambda: merge_lora_checkpoint(args.checkpoint_dir, args.out, tag=args.tag,
                                                            scaling=args.scaling)[1])
