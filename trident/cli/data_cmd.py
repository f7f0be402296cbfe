"""`trident data prepare`: tokenize text, JSON lines or Parquet into `.bin`/`.idx` shards;
`trident data inspect`: what a prepared shard holds."""

from __future__ import annotations

import argparse
import sys

from trident.cli.args import positive_int


def add_parser(subparsers) -> None:
    data = subparsers.add_parser("data", help="prepare and inspect tokenized training data")
    sub = data.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    p = sub.add_parser("prepare", help="tokenize files into memory-mapped .bin/.idx shards (Megatron's layout)",
                       description=_prepare_doc(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="INPUT", help=".txt(.gz), .jsonl(.gz)/.json or .parquet files")
    p.add_argument("--tokenizer", required=True, help='a tokenizer.json, a folder with one, a transformers '
                   'tokenizer name or folder, or "bundled" (the KJV tokenizer)')
    p.add_argument("--out", required=True, help="output folder: one <input name>.bin/.idx per input")
    p.add_argument("--workers", type=positive_int, default=1, help="tokenizer processes (default 1)")
    p.add_argument("--append-eod", action="store_true", help="end every document with the end-of-text token")
    p.add_argument("--eod-token", default=None, metavar="TEXT",
                   help="with --append-eod: the end-of-text token's text when it is not one of the usual names "
                        "(e.g. '<|eot_id|>'); an error if the tokenizer has no such token")
    p.add_argument("--key", default="text", help="JSON field / Parquet column holding the text (default: text)")
    p.set_defaults(func=run_prepare)
    q = sub.add_parser("inspect", help="documents, tokens and dtype of prepared shards")
    q.add_argument("paths", nargs="+", metavar="PATH", help="a folder of shards or a shard prefix")
    q.add_argument("--show", type=int, default=0, metavar="N", help="print the token ids of the first N documents")
    q.set_defaults(func=run_inspect)
    data.set_defaults(func=lambda args: (data.print_help(), 2)[1])


def _prepare_doc() -> str:
    from trident.data import prepare
    return prepare.__doc__


def run_prepare(args: argparse.Namespace) -> int:
    from trident.data.prepare import prepare
    try:
        summary = prepare(args.inputs, args.tokenizer, args.out, workers=args.workers,
                          append_eod=args.append_eod, key=args.key, eod_token=args.eod_token)
    except (OSError, ValueError, ImportError) as err:
        print(f"trident data prepare: {err}", file=sys.stderr)
        return 1
    print(summary.describe())
    for prefix in summary.prefixes:
        print(f"  {prefix}.bin / .idx")
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    from trident.data.samples import resolve_prefixes
    from trident.data.indexed import IndexedDataset
    try:
        for path in args.paths:
            for prefix in resolve_prefixes(path):
                ds = IndexedDataset(prefix)
                sizes = ds.sizes
                print(f"{prefix}: {len(ds):,} documents, {ds.num_tokens:,} tokens ({ds.dtype.name}), "
                      f"document length min {sizes.min() if len(ds) else 0} / mean "
                      f"{sizes.mean() if len(ds) else 0:.1f} / max {sizes.max() if len(ds) else 0}")
                for i in range(min(args.show, len(ds))):
                    print(f"  [{i}] {ds[i].tolist()}")
    except (OSError, ValueError) as err:
        print(f"trident data inspect: {err}", file=sys.stderr)
        return 1
    return 0
