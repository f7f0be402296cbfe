"""`trident doctor [--gpu]`: is this machine ready to train with trident?

Without --gpu: the versions trident runs on, then a gloo process group and data parallelism
against one process on 2 CPU ranks. With --gpu: the GPU check on every visible GPU (NCCL process
groups, DP, ZeRO-3, TP and PP against one process, bf16, pinned-memory offload, communication
overlapping backward, memory accounting, the planner's step time); a check that needs more GPUs
than this machine has prints one SKIP line. `make gpu-check` runs `trident doctor --gpu`.

Exit status: 0 when no check failed (skips are not failures), 1 when one did, 2 when --only matches no check.
"""

from __future__ import annotations

import argparse
import platform
import sys
from importlib import metadata

import torch
import torch.distributed as dist

from trident.cli.args import positive_int

CPU_CHECK_NAMES = ("process group", "dp equivalence")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("doctor", help="check this machine (CPU ranks; --gpu: every visible GPU)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", action="store_true", help="run the GPU check on every visible GPU (needs CUDA)")
    p.add_argument("--only", action="append", default=[], metavar="NAME",
                   help="run only the checks whose name contains NAME (repeatable)")
    p.add_argument("--cpu-ranks", type=positive_int, default=2, metavar="N",
                   help="gloo ranks of the CPU checks without --gpu (default 2)")
    p.set_defaults(func=run)


def versions() -> list[str]:
    """One line each: Python, torch, trident, the backends and the GPUs torch sees."""
    try:
        trident_version = metadata.version("trident")
    except metadata.PackageNotFoundError:
        trident_version = "not installed (running from the source tree)"
    lines = [f"python   {platform.python_version()}", f"torch    {torch.__version__}",
             f"trident  {trident_version}",
             f"gloo     {'available' if dist.is_gloo_available() else 'MISSING'}"]
    if torch.cuda.is_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else "MISSING"
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        lines += [f"cuda     {torch.version.cuda}, NCCL {nccl}", f"gpus     {len(names)}: {', '.join(names)}"]
    else:
        lines.append("cuda     not available (torch.cuda.is_available() is False)")
    return lines


def run(args: argparse.Namespace) -> int:
    from trident.tools import gpu_check

    for line in versions():
        print(line)
    if args.gpu:
        gpus, checks, device_type = gpu_check.visible_gpus(), gpu_check.CHECKS, "cuda"
        if gpus == 0:
            why = ("this torch is a CPU-only build; install a CUDA build of torch" if torch.version.cuda is None
                   else "run this where `nvidia-smi` lists GPUs and CUDA_VISIBLE_DEVICES does not hide them")
            print(f"no CUDA device visible: every GPU check is skipped ({why})")
    else:
        gpus, device_type = args.cpu_ranks, "cpu"
        checks = [c for c in gpu_check.CHECKS if c.name in CPU_CHECK_NAMES]
    try:
        results = gpu_check.run_checks(gpus, checks, device_type=device_type, only=args.only)
    except ValueError as e:
        print(f"trident doctor: {e}", file=sys.stderr)
        return 2
    print(gpu_check.summary(results))
    return gpu_check.exit_code(results)
