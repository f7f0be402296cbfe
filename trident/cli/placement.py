"""Where a `trident launch` runs: the nodes, this node's rank, the master and the ranks per node,
from the command line, a SLURM allocation (trident/cli/slurm.py) or a hostfile
(trident/cli/hostfile.py, run by trident/cli/multinode.py).

Flags given on the command line win over what SLURM says; a hostfile replaces --nnodes,
--node-rank and --nproc (its hosts and slots say them).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys

import trident.cli.hostfile as hostfile
import trident.cli.multinode as multinode
import trident.cli.slurm as slurm
from trident.cli.hostagent import visible_devices

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
DEFAULT_PORT = 29500


def nnodes_range(args: argparse.Namespace) -> tuple[int, int, bool]:
    """(min, max, elastic) from --nnodes N or MIN:MAX."""
    text = str(args.nnodes if args.nnodes is not None else 1)
    low, sep, high = text.partition(":")
    try:
        lo, hi = int(low), int(high if sep else low)
    except ValueError:
        raise SystemExit(f"trident launch: --nnodes expects N or MIN:MAX (e.g. 2 or 1:4), got {text!r}") from None
    if lo < 1:
        raise SystemExit(f"trident launch: --nnodes must be >= 1, got {low}")
    if hi < lo:
        raise SystemExit(f"trident launch: --nnodes {text}: MAX must be >= MIN")
    return lo, hi, bool(sep)


def is_local_host(name: str) -> bool:
    """Whether a hostfile's host name is this machine."""
    hostname = socket.gethostname()
    return name in LOCAL_NAMES or name in (hostname, hostname.split(".")[0], socket.getfqdn())


def wants_hosts(args: argparse.Namespace) -> bool:
    """A hostfile launch, or DeepSpeed's --include / --exclude / --num_nodes on this machine's GPUs."""
    return bool(getattr(args, "hostfile", None) or getattr(args, "include", "") or getattr(args, "exclude", "")
                or getattr(args, "num_nodes", -1) > 0)


# -- SLURM -------------------------------------------------------------------------------------

def slurm_allocation(args: argparse.Namespace, environ: dict) -> slurm.Allocation | None:
    if getattr(args, "no_slurm", False):
        return None
    try:
        return slurm.allocation(environ)
    except slurm.SlurmError as err:
        raise SystemExit(f"trident launch: SLURM: {err} (or run with --no-slurm)") from None


def apply_allocation(args: argparse.Namespace, alloc: slurm.Allocation) -> str:
    """Fill the flags the command line left open from a SLURM job step; a line saying so."""
    try:
        slurm.check_one_task_per_node(alloc)
    except slurm.SlurmError as err:
        raise SystemExit(f"trident launch: SLURM: {err}") from None
    if alloc.nnodes > 1 or nnodes_range(args)[2]:
        if args.nnodes is None:
            args.nnodes = str(alloc.nnodes)
        if args.node_rank is None:
            args.node_rank = alloc.node_rank
        if args.master_addr is None:
            args.master_addr = alloc.master_addr
        if args.master_port is None:
            args.master_port = alloc.master_port
    if getattr(args, "rdzv_id", None) is None:
        args.rdzv_id = f"slurm-{alloc.job_id}"
    if args.nproc is None and alloc.gpus_on_node:
        args.nproc = alloc.gpus_on_node
    here = alloc.nodes[alloc.node_rank]
    return (f"trident launch: SLURM job {alloc.job_id}: node {alloc.node_rank} of {alloc.nnodes} ({here}), "
            f"{args.nproc or 1} rank(s) here; master {args.master_addr or '127.0.0.1'}:{args.master_port or 'free'}")


def srun_fan_out(args: argparse.Namespace, alloc: slurm.Allocation) -> list[str]:
    """Outside a job step (the batch script, an salloc shell): the srun command that starts this
    same `trident ...` command once on every node of the allocation."""
    argv = getattr(args, "argv", None)
    if not argv:
        raise SystemExit(f"trident launch: SLURM job {alloc.job_id} has {alloc.nnodes} nodes; start one launcher "
                         "per node with `srun --ntasks-per-node=1 trident launch ...`")
    if shutil.which("srun") is None and not args.dry_run:
        raise SystemExit("trident launch: SLURM_JOB_NODELIST is set but there is no `srun` on PATH to start the "
                         "other nodes; run `srun --ntasks-per-node=1 trident launch ...`, or pass --no-slurm")
    return slurm.srun_argv(alloc, [sys.executable, "-m", "trident.cli.main", *argv])


# -- hostfiles -------------------------------------------------------------------------------

def _pool(args: argparse.Namespace) -> dict[str, hostfile.Host]:
    if args.hostfile:
        return hostfile.read_hostfile(args.hostfile)
    if args.num_nodes > 1:
        raise hostfile.HostfileError(f"--num_nodes {args.num_nodes} needs a --hostfile listing the nodes")
    import torch  # only here: this machine's GPUs are the slots (as DeepSpeed does without a hostfile)

    count = torch.cuda.device_count()
    if count == 0:
        raise hostfile.HostfileError("--include / --exclude without --hostfile pick GPUs of this machine, "
                                     "and it has none; give a --hostfile, or --nproc")
    return {"localhost": hostfile.Host("localhost", count, "<this machine's GPUs>", 0)}


def _check_host_flags(args: argparse.Namespace) -> None:
    given = [flag for flag, value in (("--nproc", args.nproc), ("--node-rank", args.node_rank)) if value is not None]
    if given:
        raise SystemExit(f"trident launch: {given[0]} does not go with --hostfile: its `slots=` say the ranks per "
                         "host and its order the node ranks (--num_gpus G takes the first G slots of each host)")
    if args.nnodes is not None and ":" not in str(args.nnodes):
        raise SystemExit("trident launch: --nnodes N does not go with --hostfile: its hosts are the nodes "
                         "(--num_nodes N takes the first N); --nnodes MIN:MAX makes the job elastic")
    if args.keep_going:
        raise SystemExit("trident launch: --keep-going runs one node; it does not go with --hostfile")


def host_plan(args: argparse.Namespace, target: list[str], module: bool) -> multinode.Plan | None:
    """The multi-host plan of a hostfile launch; None when it comes down to this machine alone
    (then `args` says the ranks and the visible GPUs are set, and the launch runs locally)."""
    _check_host_flags(args)
    try:
        active = hostfile.select_slots(_pool(args), args.include, args.exclude, args.num_nodes, args.num_gpus)
    except hostfile.HostfileError as err:
        raise SystemExit(f"trident launch: {err}") from None
    lo, hi, elastic = nnodes_range(args)
    if elastic and len(active) > hi:
        raise SystemExit(f"trident launch: --nnodes {args.nnodes}: the hostfile selects {len(active)} hosts, "
                         f"more than MAX")
    first = next(iter(active))
    if len(active) == 1 and is_local_host(first) and not elastic:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices(active[first], os.environ)
        args.nproc, args.nnodes, args.node_rank = len(active[first]), None, None
        return None
    launcher = args.launcher if args.launcher != "auto" else ("pdsh" if shutil.which("pdsh") else "ssh")
    master = args.master_addr or (first if args.dry_run else multinode.ask_address(first, args.ssh_port))
    port = args.master_port or DEFAULT_PORT
    plan = multinode.Plan(hosts=active, launch_args=[], master=f"{master}:{port}", launcher=launcher,
                          exports=multinode.job_exports(dict(os.environ), os.getcwd()), ssh_port=args.ssh_port)
    flags = ["--nnodes", str(args.nnodes) if elastic else str(len(active)), "--master-addr", master,
             "--master-port", str(port), "--max-restarts", str(args.max_restarts)]
    if elastic:
        flags += ["--rdzv-id", args.rdzv_id or plan.job]
    if args.log_dir:
        flags += ["--log-dir", args.log_dir]
    flags.append("--no-rank-prefix" if args.rank_prefix is False else "--rank-prefix")
    if getattr(args, "as_deepspeed", False):
        flags.append("--as-deepspeed")
    if getattr(args, "no_local_rank", False):
        flags.append("--no-local-rank")
    plan.launch_args = flags + (["-m"] if module else []) + list(target)
    return plan
