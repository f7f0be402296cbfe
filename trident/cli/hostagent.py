"""What `trident launch --hostfile` runs on every host (over ssh or pdsh), by its path (it
imports nothing but the standard library, so it starts at once):

    python -u .../trident/cli/hostagent.py --job JOB --hosts A,B --slots 0,1@0 --host A [--watch-stdin] \\
        -- LAUNCH_FLAGS... SCRIPT ARGS...

It finds its node rank (the position of --host in --hosts; pdsh passes `%h`), makes its slots
the visible GPUs (`CUDA_VISIBLE_DEVICES`; slot i is the i-th device already visible, when the
host's environment sets it), and runs `trident launch --nproc <its slots> --node-rank R
LAUNCH_FLAGS...` (torchrun's agent for this host's ranks) with the marker
`TRIDENT_LAUNCH_JOB=JOB/R` in its environment, which every rank inherits.

It ends this host's part of the job, leaving no process behind, when
- the launcher closes its stdin (`--watch-stdin`, over ssh: ssh forwards the end of its input,
  and a launcher that dies closes it too),
- it gets SIGTERM, SIGINT or SIGHUP,
- `hostagent.py --kill --job JOB` runs on the host (what pdsh runs to end a job): it sends
  SIGTERM to the job's host agents, and SIGKILL to whatever is left after --grace + 3 s,
and after the host's agent exits on its own: every process carrying the marker gets SIGTERM,
then SIGKILL after --grace seconds (torchrun starts each rank in a session of its own, so a
process group would not reach them).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

MARKER = "TRIDENT_LAUNCH_JOB"


def job_processes(job: str, exact: bool = False) -> list[int]:
    """The pids of this user's processes whose environment carries the job's marker
    (`JOB` itself, the host agents, or `JOB/R`, node R's launcher and ranks, unless `exact`)."""
    want = f"{MARKER}={job}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                entries = f.read().split(b"\0")
        except OSError:
            continue
        if want in entries or (not exact and any(e.startswith(want + b"/") for e in entries)):
            found.append(int(name))
    return found


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def end_processes(job: str, grace: float, exact: bool = False, reap: subprocess.Popen | None = None,
                  signals: tuple = (signal.SIGTERM, signal.SIGKILL)) -> None:
    """SIGTERM to every process of `job` here, SIGKILL to those still there after `grace` s
    (with `signals=(SIGKILL,)`: wait `grace` s for them to go, then SIGKILL)."""
    if len(signals) > 1:
        _signal_all(job_processes(job, exact), signals[0])
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if reap is not None:
            reap.poll()
        if not job_processes(job, exact):
            return
        time.sleep(0.05)
    _signal_all(job_processes(job, exact), signals[-1])
    if reap is not None:
        try:
            reap.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def visible_devices(slots: list[int], environ: dict) -> str:
    """CUDA_VISIBLE_DEVICES for `slots`: the slot indices themselves, or the entries they pick
    from a CUDA_VISIBLE_DEVICES the host already sets."""
    current = [d for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if not current:
        return ",".join(map(str, slots))
    if max(slots) >= len(current):
        raise SystemExit(f"trident hostagent: slot {max(slots)} is out of range: this host's "
                         f"CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']} has {len(current)} device(s)")
    return ",".join(current[s] for s in slots)


def parse_slots(text: str) -> list[list[int]]:
    """`0,1@0` -> [[0, 1], [0]]: each node's slots, in node-rank order."""
    return [[int(s) for s in part.split(",")] for part in text.split("@")]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trident/cli/hostagent.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", required=True, help="the job's id (the marker its processes carry)")
    p.add_argument("--kill", action="store_true", help="end every process of JOB on this host, then exit")
    p.add_argument("--hosts", help="every host of the job, comma-separated, in node-rank order")
    p.add_argument("--slots", help="each host's slots, '@' between hosts: 0,1@0")
    p.add_argument("--host", help="this host's name as in --hosts")
    p.add_argument("--watch-stdin", action="store_true", help="end the job when stdin closes")
    p.add_argument("--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("launch", nargs=argparse.REMAINDER, help="-- then `trident launch` flags, script and its args")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.kill:
        _signal_all(job_processes(args.job, exact=True), signal.SIGTERM)  # the agents end their own
        end_processes(args.job, args.grace + 3, signals=(signal.SIGKILL,))
        return 0
    hosts = (args.hosts or "").split(",")
    if args.host not in hosts:
        raise SystemExit(f"trident hostagent: host {args.host!r} is not one of --hosts {args.hosts}")
    rank = hosts.index(args.host)
    slots = parse_slots(args.slots)[rank]
    launch = args.launch[1:] if args.launch[:1] == ["--"] else args.launch
    env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES=visible_devices(slots, os.environ))
    env[MARKER] = f"{args.job}/{rank}"
    command = [sys.executable, "-u", "-m", "trident.cli.main", "launch", "--no-slurm", "--nproc", str(len(slots)),
               "--node-rank", str(rank), *launch]
    child = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL)
    stop = threading.Event()
    why: list[str] = []

    def on_signal(signum, _frame):
        why.append(signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    if args.watch_stdin:
        def watch():
            fd = sys.stdin.fileno()
            try:
                while os.read(fd, 4096):  # unbuffered: a buffered read would hold a lock at exit
                    pass
            except OSError:
                pass
            why.append("the launcher closed the connection")
            stop.set()
        threading.Thread(target=watch, daemon=True).start()
    while child.poll() is None and not stop.wait(0.1):
        pass
    if child.poll() is None:
        try:  # the launcher may be gone, and this host's output with it
            print(f"trident hostagent: ending node {rank} ({args.host}): {why[0] if why else 'stopped'}",
                  file=sys.stderr, flush=True)
        except OSError:
            pass
        end_processes(f"{args.job}/{rank}", args.grace, exact=True, reap=child)
        child.wait()
        return 143
    end_processes(f"{args.job}/{rank}", args.grace, exact=True)  # a rank its agent left behind
    return child.returncode if child.returncode >= 0 else 128 - child.returncode


if __name__ == "__main__":
    sys.exit(main())
