"""`trident launch`: start a training script on N processes per node with torchrun's agent.

trident does not spawn processes itself: torch.distributed.run (torchrun) starts the workers,
sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT, watches them, and restarts
the group up to `--max-restarts` times when one fails (with `checkpoint.auto_resume` in the
config, the restarted job continues from its newest complete checkpoint).

When the job fails, the last lines name the rank that failed first. Ranks that stop because
another one failed (the hang detector, a closed connection, the agent's SIGTERM) are not the
cause: each worker leaves torchrun's error file with a `trident` entry saying whether its end
was a cause (an exception, a hang report, a strict-mode divergence, a preflight mismatch) and
when; without one, a rank killed by a signal other than the agent's SIGTERM is the cause.

Several machines (docs/launching.md):
- `--hostfile FILE` (DeepSpeed's format and its --include / --exclude / --num_nodes / --num_gpus):
  one agent per host over ssh or pdsh, every host's output prefixed `[host] [rank R]`, all hosts
  ended when one fails (trident/cli/hostfile.py, multinode.py, hostagent.py);
- inside a SLURM allocation, --nnodes, --node-rank, the master and --nproc come from SLURM
  (`srun --ntasks-per-node=1 trident launch ...`; from the batch script itself, trident launch
  runs that srun) (trident/cli/slurm.py);
- by hand, `--nnodes N --node-rank R --master-addr A` on every node, or the elastic
  `--nnodes MIN:MAX` (torchrun's c10d rendezvous at A).
`--dry-run` prints what each node or host would run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.run import get_args_parser as torchrun_parser
from torch.distributed.run import run as torchrun_run

import trident.cli.multinode as multinode
import trident.cli.placement as placement
from trident.cli.hostagent import MARKER as HOST_MARKER
from trident.cli.multinode import FAILURE_RECORD
from trident.cli.placement import DEFAULT_PORT, nnodes_range
from trident.reliability.failures import ABORT_EXIT_CODE, CAUSES

RANK_PREFIX = "[rank ${rank}] "
"""torchrun's log-line prefix template for --rank-prefix (the global rank)."""


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=None,
                        help="processes per node (default 1; SLURM_GPUS_ON_NODE inside a SLURM allocation)")
    parser.add_argument("--nnodes", default=None, metavar="N|MIN:MAX", help=(
        "number of nodes (default 1; SLURM's inside an allocation); MIN:MAX is the elastic form: torchrun's "
        "c10d rendezvous at --master-addr:--master-port admits between MIN and MAX nodes and, with "
        "--max-restarts, goes on when nodes leave or join"))
    parser.add_argument("--node-rank", "--node_rank", type=int, default=None,
                        help="this node's index, 0..nnodes-1")
    parser.add_argument("--master-addr", "--master_addr", default=None,
                        help="address of node 0 (default 127.0.0.1 on one node)")
    parser.add_argument("--master-port", "--master_port", type=int, default=None,
                        help="port on node 0 (default: a free port when nnodes is 1; 29500 otherwise)")
    parser.add_argument("--rdzv-id", default=None, help="the elastic rendezvous' job id (default: SLURM's job id, "
                        "the hostfile launch's job id, else 'trident')")
    parser.add_argument("--max-restarts", "--max_restarts", type=int, default=0,
                        help="restart the whole group this many times after a worker fails")
    parser.add_argument("--log-dir", default=None, help="where torchrun keeps per-rank logs")
    parser.add_argument("--rank-prefix", action=argparse.BooleanOptionalAction, default=None, help=(
        "prefix every line a rank prints with [rank R] (default: on when the job spans several nodes)"))
    parser.add_argument("--keep-going", action="store_true", help=(
        "one node only: start the ranks directly instead of under torchrun's agent, so a rank that "
        "dies does not stop the others (asynchronous parameter servers drop a lost worker and go "
        "on); the exit code is still non-zero if any rank failed"))
    parser.add_argument("--no-slurm", action="store_true",
                        help="inside a SLURM allocation, ignore it (a plain one-node launch)")
    parser.add_argument("--dry-run", "--dry_run", action="store_true",
                        help="print the command each node (or host) would run, and start nothing")


def add_host_arguments(parser: argparse.ArgumentParser) -> None:
    """DeepSpeed's launcher flags: a hostfile and which of its hosts and slots to use."""
    group = parser.add_argument_group("several machines from a hostfile (DeepSpeed's launcher flags)")
    group.add_argument("-H", "--hostfile", default=None, help=(
        "lines `HOSTNAME slots=N`: start one agent per host over ssh (pdsh when installed), N ranks each"))
    group.add_argument("-i", "--include", default="", metavar="SPEC",
                       help="only these hosts / slots: host1:0,1@host2 (slots 0, 1 of host1, all of host2)")
    group.add_argument("-e", "--exclude", default="", metavar="SPEC", help="all but these hosts / slots (same form)")
    group.add_argument("--num-nodes", "--num_nodes", type=int, default=-1, help="the first N hosts of the hostfile")
    group.add_argument("--num-gpus", "--num_gpus", "--num_accelerators", type=int, default=-1,
                       help="the first G slots of every host (without a hostfile: --nproc G)")
    group.add_argument("--launcher", choices=("auto", "ssh", "pdsh"), default="auto",
                       help="how to reach the hosts (auto: pdsh when installed, else ssh)")
    group.add_argument("--ssh-port", "--ssh_port", type=int, default=None, help="ssh port of the hosts")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("launch", help="run a script on N processes (torchrun's elastic agent)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_launch_arguments(p)
    add_host_arguments(p)
    p.add_argument("--as-deepspeed", action="store_true", help=(
        "run an unmodified DeepSpeed script: `import deepspeed` and every `from deepspeed.x import y` resolve to "
        "trident on every rank (when DeepSpeed itself is not installed), and the script gets --local_rank=N "
        "as DeepSpeed's launcher passes it"))
    p.add_argument("--no-local-rank", "--no_local_rank", dest="no_local_rank", action="store_true",
                   help="with --as-deepspeed: do not pass --local_rank (DeepSpeed launcher's --no_local_rank)")
    p.add_argument("-m", "--module", action="store_true", help="treat script as a python module name")
    p.add_argument("script", help="training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=run)


def validate(args: argparse.Namespace) -> None:
    if args.nproc < 1:
        raise SystemExit(f"trident launch: --nproc must be >= 1, got {args.nproc}")
    lo, _, elastic = nnodes_range(args)
    if not elastic and not 0 <= args.node_rank < lo:
        raise SystemExit(f"trident launch: --node-rank must be in 0..{lo - 1} "
                         f"for --nnodes {lo}, got {args.node_rank}")
    _check_ranges(args)


def _check_target(target: list[str], module: bool) -> None:
    """Fail here, once, rather than in every worker, when the script or module does not exist."""
    name = target[0]
    if module:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise SystemExit(f"trident launch: no module named {name!r} (given with -m); check the name "
                             f"and that its package is importable from {os.getcwd()}")
    elif not os.path.isfile(name):
        raise SystemExit(f"trident launch: script {name!r} does not exist or is not a file; give the path "
                         f"of your training script (or -m package.module)")


def worker_target(args: argparse.Namespace, target: list[str], module: bool) -> list[str]:
    """`target` run through `trident.cli.worker` (a module), which records every failure once and,
    with --as-deepspeed, resolves `deepspeed` to trident."""
    flags = []
    if getattr(args, "as_deepspeed", False):
        flags += ["--as-deepspeed"] + ([] if getattr(args, "no_local_rank", False) else ["--local-rank-arg"])
    return ["trident.cli.worker", *flags, *(["-m"] if module else []), *target]


def rank_prefix(args: argparse.Namespace) -> bool:
    """--rank-prefix, or by default whether the job may span several nodes."""
    flag = getattr(args, "rank_prefix", None)
    return flag if flag is not None else nnodes_range(args)[1] > 1


def torchrun_argv(args: argparse.Namespace, target: list[str], module: bool) -> list[str]:
    """torchrun's command line for trident's launch flags."""
    argv = [f"--nproc-per-node={args.nproc}", f"--max-restarts={args.max_restarts}"]
    lo, hi, elastic = nnodes_range(args)
    addr, port = args.master_addr or "127.0.0.1", args.master_port or DEFAULT_PORT
    if elastic:
        argv += [f"--nnodes={lo}:{hi}", "--rdzv-backend=c10d", f"--rdzv-endpoint={addr}:{port}",
                 f"--rdzv-id={getattr(args, 'rdzv_id', None) or 'trident'}"]
    elif lo == 1 and args.master_port is None:
        argv.append("--standalone")
    else:
        argv += [f"--nnodes={lo}", f"--node-rank={args.node_rank}", f"--master-addr={addr}", f"--master-port={port}"]
    if args.log_dir:
        argv.append(f"--log-dir={args.log_dir}")
    if rank_prefix(args):
        argv.append("--tee=3")  # torchrun then prefixes each line (RANK_PREFIX)
    if module:
        argv.append("-m")
    return argv + target


def _entry(failure: ProcessFailure) -> dict:
    data = failure.error_file_data
    entry = data.get("trident") if isinstance(data, dict) else None
    return entry if isinstance(entry, dict) else {}


def _message(failure: ProcessFailure) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    return str(message or "")


def first_failure(failures: dict[int, ProcessFailure]) -> tuple[int, str]:
    """The rank whose failure caused the others, and what happened to it (see module doc)."""
    rank, what, _, _ = _first_failure(failures)
    return rank, what


def _first_failure(failures: dict[int, ProcessFailure]) -> tuple[int, str, bool, float]:
    """first_failure's rank and text, whether it is a cause (not a rank stopped because of
    another's failure, as far as this node can tell) and when it happened."""
    entries = {rank: _entry(f) for rank, f in failures.items()}
    causes = sorted((e["time"], rank) for rank, e in entries.items()
                    if e.get("kind") in CAUSES and isinstance(e.get("time"), (int, float)))
    if causes:
        when, reporter = causes[0]
        entry = entries[reporter]
        if entry["kind"] in ("hang", "divergence") and entry.get("culprits"):
            culprit = int(entry["culprits"][0])
            return culprit, f"{entry.get('headline', '')} (reported by rank {reporter})", True, when
        return reporter, entry.get("error") or _message(failures[reporter]), True, when
    signalled = sorted((f.timestamp, rank) for rank, f in failures.items()
                       if f.exitcode < 0 and -f.exitcode != signal.SIGTERM)
    if signalled:
        when, rank = signalled[0]
        return rank, f"killed by signal {-failures[rank].exitcode} ({failures[rank].signal_name()})", True, when
    own = sorted((f.timestamp, rank) for rank, f in failures.items()
                 if f.exitcode not in (ABORT_EXIT_CODE, -signal.SIGTERM) and not entries[rank])
    comm = sorted((e["time"], rank) for rank, e in entries.items()
                  if e.get("kind") == "comm" and isinstance(e.get("time"), (int, float)))
    if own or comm:
        when, rank = (own or comm)[0]
    else:
        rank = min(failures, key=lambda r: failures[r].timestamp)
        when = failures[rank].timestamp
    what = entries[rank].get("error") or _message(failures[rank]) or f"exit code {failures[rank].exitcode}"
    return rank, what, bool(own), when


def failure_report(failures: dict[int, ProcessFailure]) -> str:
    """The closing lines of a failed job: the first failure's traceback when its rank left it to
    the launcher (printed once, here), then where it happened and what it was."""
    rank, what = first_failure(failures)
    failure = failures.get(rank)
    entry = _entry(failure) if failure is not None else {}
    host = f" on host {entry['host']}" if entry.get("host") else ""
    where = (f"{host} (local rank {failure.local_rank}, pid {failure.pid}, exit code {failure.exitcode})"
             if failure is not None else " (on another node)")
    trace = ""
    if entry.get("printed") is False:
        message = failure.error_file_data.get("message", {}) if isinstance(failure.error_file_data, dict) else {}
        stack = message.get("extraInfo", {}).get("py_callstack", "") if isinstance(message, dict) else ""
        trace = f"\ntrident launch: traceback of rank {rank}{host}:\n{stack.rstrip()}" if stack else ""
    return (f"{trace}\ntrident launch: the job failed; first failure on global rank {rank}{where}.\n"
            f"trident launch: rank {rank}: {what}")


def launch_keep_going(args: argparse.Namespace, target: list[str], module: bool) -> int:
    """`--keep-going`: the ranks as plain child processes with torchrun's environment variables,
    each left to finish whatever happens to the others; returns 1 if any rank failed."""
    if nnodes_range(args) != (1, 1, False) or args.max_restarts:
        raise SystemExit("trident launch: --keep-going runs one node without restarts; drop --nnodes / "
                         "--max-restarts, or drop --keep-going")
    port = args.master_port or _free_port()
    command = [sys.executable, "-m", *worker_target(args, target, module)]
    procs = []
    for rank in range(args.nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc),
                   LOCAL_WORLD_SIZE=str(args.nproc), GROUP_RANK="0", MASTER_ADDR=args.master_addr or "127.0.0.1",
                   MASTER_PORT=str(port))
        env.setdefault("OMP_NUM_THREADS", "1")
        procs.append(subprocess.Popen(command, env=env))
    codes = [p.wait() for p in procs]
    failed = [(rank, code) for rank, code in enumerate(codes) if code != 0]
    if failed:
        listed = ", ".join(f"rank {r} (exit code {c})" for r, c in failed)
        print(f"\ntrident launch: {len(failed)} of {args.nproc} rank(s) failed: {listed}; the others ran to "
              "the end (--keep-going)", file=sys.stderr)
        return 1
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _place(args: argparse.Namespace, target: list[str], module: bool) -> int | None:
    """A hostfile's hosts or a SLURM allocation outside a job step: start them (or print how, with
    --dry-run) and return the exit code. Otherwise fill in what SLURM says and return None."""
    if placement.wants_hosts(args):
        _check_ranges(args)
        plan = placement.host_plan(args, target, module)
        if plan is None:  # the hostfile names this machine alone
            return None
        _check_target(target, module)
        if args.dry_run:
            print(plan.dry_run())
            return 0
        return multinode.run(plan)
    alloc = placement.slurm_allocation(args, dict(os.environ))
    if alloc is None:
        return None
    if alloc.nnodes > 1 and not alloc.in_step:
        argv = placement.srun_fan_out(args, alloc)
        _check_target(target, module)
        print(f"trident launch: SLURM job {alloc.job_id} has {alloc.nnodes} nodes and this is not a job step; "
              f"starting one launcher per node:\n{shlex.join(argv)}", file=sys.stderr, flush=True)
        if args.dry_run:
            return 0
        sys.stdout.flush()
        os.execvp(argv[0], argv)
    print(placement.apply_allocation(args, alloc), file=sys.stderr, flush=True)
    return None


def _check_ranges(args: argparse.Namespace) -> None:
    if args.max_restarts < 0:
        raise SystemExit(f"trident launch: --max-restarts must be >= 0, got {args.max_restarts}")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise SystemExit(f"trident launch: --master-port must be in 1..65535, got {args.master_port}")


def launch(args: argparse.Namespace, target: list[str], module: bool) -> int:
    """Run `target` under torchrun; returns the exit code (non-zero if any rank failed)."""
    done = _place(args, target, module)
    if done is not None:
        return done
    num_gpus = getattr(args, "num_gpus", -1)
    if num_gpus > 0 and args.nproc is not None and args.nproc != num_gpus:
        raise SystemExit(f"trident launch: --num_gpus {num_gpus} and --nproc {args.nproc} disagree; give one")
    if args.nproc is None:
        args.nproc = num_gpus if num_gpus > 0 else getattr(args, "default_nproc", 1)
    if args.node_rank is None:
        args.node_rank = 0
    validate(args)
    _check_target(target, module)
    if getattr(args, "keep_going", False):
        return launch_keep_going(args, target, module)
    argv = torchrun_argv(args, worker_target(args, target, module), module=True)
    if getattr(args, "dry_run", False):
        devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        env = f"CUDA_VISIBLE_DEVICES={devices} " if devices is not None else ""
        print(f"{env}{shlex.join([sys.executable, '-m', 'torch.distributed.run', *argv])}")
        return 0
    # torchrun's agent otherwise shares one store across restarts, and the workers of a
    # restarted group can read the previous group's stale gloo addresses and refuse to start;
    # with this set, every attempt's rank 0 starts a fresh store.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    logs = None
    if rank_prefix(args):
        os.environ.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", RANK_PREFIX)
        if not args.log_dir:  # torchrun tees through log files; keep them only where asked to
            logs = tempfile.mkdtemp(prefix="trident-launch-logs-")
            argv.insert(0, f"--log-dir={logs}")
    try:
        torchrun_run(torchrun_parser().parse_args(argv))
    except ChildFailedError as err:
        if os.environ.get(HOST_MARKER):  # under a hostfile launch's host agent: for its launcher to compare
            rank, _, cause, when = _first_failure(err.failures)
            print(f"{FAILURE_RECORD}{json.dumps({'rank': rank, 'cause': cause, 'time': when})}", file=sys.stderr)
        print(failure_report(err.failures), file=sys.stderr)
        return 1
    except SignalException as err:  # the agent was told to stop (a hostfile launch ending this host)
        print(f"trident launch: stopped by {err.sigval.name}; the ranks here were ended", file=sys.stderr)
        return 128 + int(err.sigval)
    finally:
        if logs is not None:
            shutil.rmtree(logs, ignore_errors=True)
    return 0


def run(args: argparse.Namespace) -> int:
    return launch(args, [args.script, *args.script_args], module=args.module)
