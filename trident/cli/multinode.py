"""`trident launch --hostfile`: one torchrun agent per host, started over ssh (or pdsh).

Each host runs `trident.cli.hostagent` (see there), which starts `trident launch` for that
host's slots and ends them all when told to. This side:

- builds each host's command: `cd` to this directory, the environment a job needs exported,
  then the host agent. Exported are PYTHONPATH (this directory first, as DeepSpeed does), every
  variable whose name starts with NCCL, PYTHON, MV2, UCX, MLFLOW, GLOO or TRIDENT, and the
  `NAME=VALUE` lines of a `.deepspeed_env` file (the name `DS_ENV_FILE` gives, if set) in the
  home directory and then in this directory (its values are double-quoted, so `$VAR` expands on
  the host, as with DeepSpeed; blank lines and `#` comments are skipped);
- streams every host's output, each line prefixed `[host]` (and `[rank R]` from torchrun);
- over ssh, ends the other hosts as soon as one fails (it closes their ssh's input; the host
  agent ends its processes), and all of them on Ctrl-C / SIGTERM; over pdsh, which starts all
  hosts in one process, it runs `hostagent.py --kill --job JOB` on every host instead;
- ends with the first failed host's own report (rank, host, error) as its last lines.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

EXPORT_PREFIXES = ("NCCL", "PYTHON", "MV2", "UCX", "MLFLOW", "GLOO", "TRIDENT")
"""DeepSpeed's runner exports names starting with MLFLOW, PYTHON, MV2, UCX and the accelerator's
(NCCL on CUDA); trident adds its own TRIDENT_* and GLOO_* (gloo's interface choice)."""

HOST_AGENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hostagent.py")
"""Run by its path (it needs only the standard library): `-m trident.cli.hostagent` would import
trident's package, torch with it, and take seconds to start."""

FAILURE_RECORD = "trident launch: failure record "
"""The line a host's launcher prints before its failure report: JSON {rank, cause, time}."""

_PDSH_FAILED = re.compile(r"^pdsh@[^:]*: (?P<host>[^:\s]+): ssh exited with exit code (?P<code>\d+)")
_PDSH_LINE = re.compile(r"^(?P<host>[^:\s]+): (?P<text>.*)$", re.S)


def new_job_id() -> str:
    return f"trident-{secrets.token_hex(6)}"


def read_env_file(path: str) -> list[tuple[str, str]]:
    """The NAME=VALUE lines of a `.deepspeed_env`-style file (errors name the file and line)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for number, raw in enumerate(f, start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            name, sep, value = line.partition("=")
            name = name.strip()
            if line.startswith("export "):
                name = name[len("export "):].strip()
            if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise SystemExit(f"trident launch: {path}:{number}: expected NAME=VALUE, got {raw.strip()!r}")
            out.append((name, value.strip()))
    return out


def env_files(environ: dict, cwd: str) -> list[str]:
    """The `.deepspeed_env` files that exist, home directory first (the later one wins)."""
    name = environ.get("DS_ENV_FILE", ".deepspeed_env")
    found = []
    for folder in (os.path.expanduser("~"), cwd):
        path = os.path.join(folder, name)
        if os.path.isfile(path) and os.path.abspath(path) not in found:
            found.append(os.path.abspath(path))
    return found


def _double_quoted(value: str) -> str:
    return '"' + re.sub(r'(["\\`])', r"\\\1", value) + '"'


def job_exports(environ: dict, cwd: str) -> dict[str, str]:
    """NAME -> the shell text of its value, for every variable a host gets (see module doc)."""
    exports = {name: shlex.quote(value) for name, value in sorted(environ.items())
               if name.startswith(EXPORT_PREFIXES) and not name.startswith("TRIDENT_LAUNCH_JOB")}
    path = environ.get("PYTHONPATH")
    exports["PYTHONPATH"] = shlex.quote(cwd + (":" + path if path else ""))
    for env_file in env_files(environ, cwd):
        for name, value in read_env_file(env_file):
            exports[name] = _double_quoted(value)
    return exports


@dataclass
class Plan:
    """A multi-host job: which slots of which hosts, and what each host runs."""

    hosts: dict[str, list[int]]
    launch_args: list[str]
    """`trident launch` flags, script and its arguments, the same on every host (the host agent
    adds --nproc and --node-rank)."""
    master: str
    launcher: str = "ssh"
    job: str = field(default_factory=new_job_id)
    exports: dict[str, str] = field(default_factory=dict)
    cwd: str = field(default_factory=os.getcwd)
    python: str = sys.executable
    ssh_port: int | None = None
    grace: float = 5.0

    def remote_command(self, host: str) -> str:
        """The shell command a host runs (`%h` for pdsh to fill in)."""
        exported = {**self.exports, "TRIDENT_LAUNCH_JOB": self.job}
        exports = " ".join(f"{name}={value}" for name, value in exported.items())
        slots = "@".join(",".join(map(str, s)) for s in self.hosts.values())
        agent = [self.python, "-u", HOST_AGENT, "--job", self.job, "--hosts", ",".join(self.hosts),
                 "--slots", slots, "--host", host, "--grace", f"{self.grace:g}"]
        if self.launcher == "ssh":
            agent.append("--watch-stdin")
        return (f"cd {shlex.quote(self.cwd)} && export {exports} && exec {shlex.join(agent)} -- "
                f"{shlex.join(self.launch_args)}")

    def ssh_argv(self, host: str, command: str) -> list[str]:
        port = ["-p", str(self.ssh_port)] if self.ssh_port else []
        return ["ssh", "-o", "BatchMode=yes", *port, host, command]

    def pdsh_argv(self, command: str) -> list[str]:
        return ["pdsh", "-S", "-f", "1024", "-w", ",".join(self.hosts), command]

    def pdsh_env(self) -> dict:
        env = dict(os.environ, PDSH_RCMD_TYPE="ssh")
        if self.ssh_port:
            env["PDSH_SSH_ARGS_APPEND"] = f"{env.get('PDSH_SSH_ARGS_APPEND', '')} -p {self.ssh_port}".strip()
        return env

    def kill_argv(self) -> list[str]:
        return self.pdsh_argv(shlex.join([self.python, HOST_AGENT, "--kill", "--job", self.job]))

    def describe(self) -> str:
        listed = ", ".join(f"{host} (node {i}, slots {','.join(map(str, slots))})"
                           for i, (host, slots) in enumerate(self.hosts.items()))
        ranks = sum(len(s) for s in self.hosts.values())
        return (f"job {self.job}: {ranks} rank(s) on {len(self.hosts)} host(s) over {self.launcher}: {listed}; "
                f"master {self.master}")

    def dry_run(self) -> str:
        lines = [f"trident launch: {self.describe()} (dry run: nothing started)"]
        if self.launcher == "pdsh":
            lines.append(shlex.join(self.pdsh_argv(self.remote_command("%h"))))
        else:
            for i, (host, slots) in enumerate(self.hosts.items()):
                lines.append(f"# {host}: node {i}, slots {','.join(map(str, slots))}")
                lines.append(shlex.join(self.ssh_argv(host, self.remote_command(host))))
        return "\n".join(lines)


def ask_address(host: str, ssh_port: int | None) -> str:
    """The first address `hostname -I` prints on `host` (how DeepSpeed finds the master)."""
    port = ["-p", str(ssh_port)] if ssh_port else []
    try:
        out = subprocess.run(["ssh", "-o", "BatchMode=yes", *port, host, "hostname -I"], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as err:
        out, problem = None, str(err)
    else:
        problem = out.stderr.strip() or f"exit code {out.returncode}"
    if out is None or out.returncode != 0 or not out.stdout.split():
        raise SystemExit(f"trident launch: could not ask {host} for its address over ssh (`hostname -I`: "
                         f"{problem}); give the address of the first host with --master-addr")
    return out.stdout.split()[0]


class _Output:
    """Writes the hosts' lines, whole, each prefixed by its host; keeps their reports."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reports: dict[str, list[str]] = {}
        self.records: dict[str, dict] = {}
        self.pdsh_failed: list[tuple[str, int]] = []

    def pump(self, stream, dst, host: str | None) -> None:
        for raw in iter(stream.readline, b""):
            text = raw.decode("utf-8", errors="replace").rstrip("\n")
            who = host
            if host is None:  # pdsh: "host: text", and its own "pdsh@...: host: ssh exited with exit code N"
                failed = _PDSH_FAILED.match(text)
                if failed:
                    self.pdsh_failed.append((failed.group("host"), int(failed.group("code"))))
                match = _PDSH_LINE.match(text)
                who, text = (match.group("host"), match.group("text")) if match and not failed else ("pdsh", text)
            if text.startswith(FAILURE_RECORD):
                try:
                    self.records[who] = json.loads(text[len(FAILURE_RECORD):])
                except ValueError:
                    pass
                continue
            if text.startswith(("trident launch: the job failed", "trident launch: rank ")):
                self.reports.setdefault(who, []).append(text)
            with self.lock:
                dst.write(f"[{who}] {text}\n")
                dst.flush()
        stream.close()


def _start_pumps(out: _Output, proc: subprocess.Popen, host: str | None) -> list[threading.Thread]:
    threads = [threading.Thread(target=out.pump, args=(proc.stdout, sys.stdout, host), daemon=True),
               threading.Thread(target=out.pump, args=(proc.stderr, sys.stderr, host), daemon=True)]
    for t in threads:
        t.start()
    return threads


def run(plan: Plan) -> int:
    """Run the job; the exit code (0 when every host succeeded)."""
    print(f"trident launch: {plan.describe()}", file=sys.stderr, flush=True)
    out = _Output()
    stopped: list[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda signum, _f: stopped.append(signum))
    try:
        if plan.launcher == "pdsh":
            return _run_pdsh(plan, out, stopped)
        return _run_ssh(plan, out, stopped)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run_ssh(plan: Plan, out: _Output, stopped: list[int]) -> int:
    procs: dict[str, subprocess.Popen] = {}
    threads = []
    for host in plan.hosts:
        procs[host] = subprocess.Popen(plan.ssh_argv(host, plan.remote_command(host)), stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        threads += _start_pumps(out, procs[host], host)
    codes: dict[str, int] = {}
    failed: str | None = None
    ending_since: float | None = None
    while len(codes) < len(procs):
        for host, proc in procs.items():
            if host not in codes and proc.poll() is not None:
                codes[host] = proc.returncode
                if proc.returncode != 0 and failed is None and ending_since is None:
                    failed = host
        if ending_since is None and (failed is not None or stopped):
            ending_since = time.monotonic()
            for host, proc in procs.items():
                if host not in codes:
                    _close(proc.stdin)
        if ending_since is not None:
            waited = time.monotonic() - ending_since
            for host, proc in procs.items():
                if host not in codes:
                    if waited > plan.grace + 10:
                        proc.kill()
                    elif waited > plan.grace + 5:
                        proc.terminate()
        time.sleep(0.05)
    for t in threads:
        t.join(timeout=5)
    return _finish(plan, out, codes, failed, stopped)


def _close(stream) -> None:
    try:
        stream.close()
    except OSError:
        pass


def _run_pdsh(plan: Plan, out: _Output, stopped: list[int]) -> int:
    proc = subprocess.Popen(plan.pdsh_argv(plan.remote_command("%h")), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=plan.pdsh_env(),
                            start_new_session=True)
    threads = _start_pumps(out, proc, None)
    ending_since: float | None = None
    while proc.poll() is None:
        if ending_since is None and (out.pdsh_failed or stopped):
            ending_since = time.monotonic()
            subprocess.run(plan.kill_argv(), env=plan.pdsh_env(), stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
        if ending_since is not None and time.monotonic() - ending_since > plan.grace + 10:
            proc.terminate()
        time.sleep(0.05)
    for t in threads:
        t.join(timeout=5)
    codes = {host: 0 for host in plan.hosts}
    codes.update({host: code for host, code in out.pdsh_failed})
    failed = out.pdsh_failed[0][0] if out.pdsh_failed else None
    if proc.returncode != 0 and failed is None and not stopped:
        print(f"trident launch: pdsh exited with code {proc.returncode}", file=sys.stderr, flush=True)
        return proc.returncode
    return _finish(plan, out, codes, failed, stopped)


def first_failed_host(codes: dict[str, int], records: dict[str, dict], observed: str) -> str:
    """The host whose failure the others followed: the earliest one whose own launcher names a
    cause (an exception, a hang or divergence report, a rank killed by a signal), else the host
    seen failing first. (A rank on one host usually fails first; the others then stop on a closed
    connection or a hang report, and their hosts may end a moment earlier.)"""
    causes = sorted((r.get("time", 0.0), host) for host, r in records.items()
                    if r.get("cause") and codes.get(host, 1) != 0)
    return causes[0][1] if causes else observed


def _finish(plan: Plan, out: _Output, codes: dict[str, int], failed: str | None, stopped: list[int]) -> int:
    if stopped and failed is None:
        name = signal.Signals(stopped[0]).name
        print(f"trident launch: {name}: ended the job on every host", file=sys.stderr, flush=True)
        return 128 + stopped[0]
    if failed is None:
        return 0
    failed = first_failed_host(codes, out.records, failed)
    node = list(plan.hosts).index(failed) if failed in plan.hosts else "?"
    others = [h for h in plan.hosts if h != failed]
    print(f"\ntrident launch: host {failed} (node {node}) failed first; ended the other host(s): "
          f"{', '.join(others) or 'none'}", file=sys.stderr)
    for line in out.reports.get(failed, [])[-2:]:
        print(f"[{failed}] {line}", file=sys.stderr)
    if plan.launcher == "ssh" and codes.get(failed) == 255 and failed not in out.reports:
        print(f"trident launch: ssh could not run the command on {failed} (exit code 255); check that "
              f"`ssh -o BatchMode=yes {failed} hostname` works without a password", file=sys.stderr)
    sys.stderr.flush()
    return 1
