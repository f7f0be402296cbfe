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
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import socket
import subprocess
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.run import get_args_parser as torchrun_parser
from torch.distributed.run import run as torchrun_run

from trident.reliability.failures import ABORT_EXIT_CODE, CAUSES


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=1, help="processes per node")
    parser.add_argument("--nnodes", type=int, default=1, help="number of nodes")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's index, 0..nnodes-1")
    parser.add_argument("--master-addr", default="127.0.0.1", help="address of node 0")
    parser.add_argument("--master-port", type=int, default=None,
                        help="port on node 0 (default: a free port when nnodes is 1; 29500 otherwise)")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="restart the whole group this many times after a worker fails")
    parser.add_argument("--log-dir", default=None, help="where torchrun keeps per-rank logs")
    parser.add_argument("--keep-going", action="store_true", help=(
        "one node only: start the ranks directly instead of under torchrun's agent, so a rank that "
        "dies does not stop the others (asynchronous parameter servers drop a lost worker and go "
        "on); the exit code is still non-zero if any rank failed"))


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("launch", help="run a script on N processes (torchrun's elastic agent)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_launch_arguments(p)
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
    if args.nnodes < 1:
        raise SystemExit(f"trident launch: --nnodes must be >= 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        raise SystemExit(f"trident launch: --node-rank must be in 0..{args.nnodes - 1} "
                         f"for --nnodes {args.nnodes}, got {args.node_rank}")
    if args.max_restarts < 0:
        raise SystemExit(f"trident launch: --max-restarts must be >= 0, got {args.max_restarts}")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise SystemExit(f"trident launch: --master-port must be in 1..65535, got {args.master_port}")


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


def torchrun_argv(args: argparse.Namespace, target: list[str], module: bool) -> list[str]:
    """torchrun's command line for trident's launch flags."""
    argv = [f"--nproc-per-node={args.nproc}", f"--max-restarts={args.max_restarts}"]
    if args.nnodes == 1 and args.master_port is None:
        argv.append("--standalone")
    else:
        argv += [f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank}",
                 f"--master-addr={args.master_addr}", f"--master-port={args.master_port or 29500}"]
    if args.log_dir:
        argv.append(f"--log-dir={args.log_dir}")
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
    entries = {rank: _entry(f) for rank, f in failures.items()}
    causes = sorted((e["time"], rank) for rank, e in entries.items()
                    if e.get("kind") in CAUSES and isinstance(e.get("time"), (int, float)))
    if causes:
        reporter = causes[0][1]
        entry = entries[reporter]
        if entry["kind"] in ("hang", "divergence") and entry.get("culprits"):
            culprit = int(entry["culprits"][0])
            return culprit, f"{entry.get('headline', '')} (reported by rank {reporter})"
        return reporter, entry.get("error") or _message(failures[reporter])
    signalled = sorted((f.timestamp, rank) for rank, f in failures.items()
                       if f.exitcode < 0 and -f.exitcode != signal.SIGTERM)
    if signalled:
        rank = signalled[0][1]
        return rank, f"killed by signal {-failures[rank].exitcode} ({failures[rank].signal_name()})"
    own = sorted((f.timestamp, rank) for rank, f in failures.items()
                 if f.exitcode not in (ABORT_EXIT_CODE, -signal.SIGTERM) and not entries[rank])
    comm = sorted((e["time"], rank) for rank, e in entries.items()
                  if e.get("kind") == "comm" and isinstance(e.get("time"), (int, float)))
    if own or comm:
        rank = (own or comm)[0][1]
    else:
        rank = min(failures, key=lambda r: failures[r].timestamp)
    return rank, entries[rank].get("error") or _message(failures[rank]) or f"exit code {failures[rank].exitcode}"


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
    if args.nnodes != 1 or args.max_restarts:
        raise SystemExit("trident launch: --keep-going runs one node without restarts; drop --nnodes / "
                         "--max-restarts, or drop --keep-going")
    port = args.master_port or _free_port()
    command = [sys.executable, "-m", *worker_target(args, target, module)]
    procs = []
    for rank in range(args.nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc),
                   LOCAL_WORLD_SIZE=str(args.nproc), GROUP_RANK="0", MASTER_ADDR=args.master_addr,
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


def launch(args: argparse.Namespace, target: list[str], module: bool) -> int:
    """Run `target` under torchrun; returns the exit code (non-zero if any rank failed)."""
    validate(args)
    _check_target(target, module)
    if getattr(args, "keep_going", False):
        return launch_keep_going(args, target, module)
    parsed = torchrun_parser().parse_args(torchrun_argv(args, worker_target(args, target, module), module=True))
    # torchrun's agent otherwise shares one store across restarts, and the workers of a
    # restarted group can read the previous group's stale gloo addresses and refuse to start;
    # with this set, every attempt's rank 0 starts a fresh store.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    try:
        torchrun_run(parsed)
    except ChildFailedError as err:
        print(failure_report(err.failures), file=sys.stderr)
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    return launch(args, [args.script, *args.script_args], module=args.module)
