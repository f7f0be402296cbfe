"""`trident pipeline show --stages P --micro-batches M --schedule S [--virtual-stages V] [--png FILE]`.

Builds every stage's instruction list for the schedule, checks it (each send meets its
receive, every micro-batch goes forward then backward, no stage waits forever), simulates it
with the given instruction costs and prints the timeline, each stage's idle share and its
peak number of live activations. With --png the timeline is also drawn to FILE.
"""

from __future__ import annotations

import argparse
import sys

from trident.cli.args import positive_int
from trident.pipeline.schedules import SCHEDULES, build_all
from trident.pipeline.simulate import Costs, ScheduleError, check_schedule, simulate


def _cost(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative number, got {text!r}")
    return value


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `trident pipeline ...`."""
    p = subparsers.add_parser("pipeline", help="inspect pipeline schedules")
    sub = p.add_subparsers(dest="pipeline_command", metavar="SUBCOMMAND")
    s = sub.add_parser("show", help="draw a schedule's timeline", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--stages", type=positive_int, required=True, help="pipeline stages P")
    s.add_argument("--micro-batches", type=positive_int, required=True, help="micro-batches per step M")
    s.add_argument("--schedule", choices=list(SCHEDULES), required=True, help="the schedule")
    s.add_argument("--virtual-stages", type=positive_int, default=1,
                   help="model chunks per stage (interleaved_1f1b only; default 1)")
    s.add_argument("--forward", type=_cost, default=1.0, help="cost of a forward (default 1)")
    s.add_argument("--backward", type=_cost, default=2.0, help="cost of a whole backward (default 2)")
    s.add_argument("--backward-weight", type=_cost, default=1.0,
                   help="cost of a weight pass W; the input pass b costs backward - W (default 1)")
    s.add_argument("--p2p", type=_cost, default=0.0, help="latency of a transfer (default 0)")
    s.add_argument("--png", metavar="FILE", default=None, help="also draw the timeline to this PNG file")
    s.set_defaults(func=run)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
    return p


def run(args: argparse.Namespace) -> int:
    """Print the schedule's timeline (and write the PNG); 1 on a bad combination of options."""
    from trident.pipeline.draw import save_png, text_timeline

    if args.backward_weight > args.backward:
        print(f"trident pipeline show: --backward-weight {args.backward_weight} exceeds --backward "
              f"{args.backward}; the weight pass is part of the backward", file=sys.stderr)
        return 1
    costs = Costs(forward=args.forward, backward=args.backward, backward_input=args.backward - args.backward_weight,
                  backward_weight=args.backward_weight, p2p=args.p2p)
    try:
        programs = build_all(args.schedule, args.stages, args.micro_batches, args.virtual_stages)
        check_schedule(programs, args.micro_batches, args.virtual_stages)
    except (ValueError, ScheduleError) as err:
        print(f"trident pipeline show: {err}", file=sys.stderr)
        return 1
    timeline = simulate(programs, costs)
    title = (f"{args.schedule}: {args.stages} stages x {args.virtual_stages} chunk(s), {args.micro_batches} "
             f"micro-batches; bubble {100 * timeline.bubble_fraction():.1f}%")
    print(title)
    print(text_timeline(timeline))
    if args.png:
        print(f"wrote {save_png(timeline, args.png, title)}")
    return 0
