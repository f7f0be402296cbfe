"""`trident launch --hostfile` on two "hosts" of this machine (issue 33).

The hosts are names in a hostfile (`hostA slots=1`, `hostB slots=1`); a stub `ssh` on PATH (what
the launcher's contract needs: `ssh [options] HOST COMMAND` runs COMMAND on HOST) drops the
options and the host and runs the command here, in an emptied environment as a fresh login
would have, so the job gets only what the launcher exports. A stub `pdsh` does the same for
pdsh's form (`pdsh -w A,B COMMAND`, with %h the host, output lines prefixed `host: `).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.scripts.hosts_script import LR, global_batch, make_model
from tests.scripts.jobs import TRIDENT, run_trident
from trident.cli.hostagent import job_processes
from trident.testing.parity import assert_losses_close, assert_state_close, train_serial

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
SCRIPT = str(SCRIPTS / "hosts_script.py")
pytestmark = pytest.mark.launch

STUB_SSH = """#!/bin/bash
# ssh [options] HOST COMMAND...: run COMMAND here, in a login-like empty environment
while [ $# -gt 0 ]; do
  case "$1" in
    -o|-p|-l|-i|-F|-J) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
host="$1"; shift
exec env -i HOME="$HOME" PATH="$PATH" STUB_HOST="$host" bash -c "$*"
"""

STUB_PDSH = """#!{python}
# pdsh [-S] [-f N] -w HOST,HOST COMMAND: COMMAND on every host here (%h: the host), lines prefixed
import os, subprocess, sys, threading
args, hosts = sys.argv[1:], []
while args and args[0].startswith("-"):
    flag = args.pop(0)
    if flag in ("-w", "-f"):
        value = args.pop(0)
        hosts = value.split(",") if flag == "-w" else hosts
command = " ".join(args)
lock, codes = threading.Lock(), []

def pump(host, stream, dst):
    for line in iter(stream.readline, ""):
        with lock:
            dst.write(host + ": " + line)
            dst.flush()

def run(host):
    env = {{"HOME": os.environ["HOME"], "PATH": os.environ["PATH"]}}
    p = subprocess.Popen(["bash", "-c", command.replace("%h", host)], env=env, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pumps = [threading.Thread(target=pump, args=(host, p.stdout, sys.stdout)),
             threading.Thread(target=pump, args=(host, p.stderr, sys.stderr))]
    for t in pumps:
        t.start()
    code = p.wait()
    for t in pumps:
        t.join()
    if code:
        with lock:
            sys.stderr.write(f"pdsh@stub: {{host}}: ssh exited with exit code {{code}}\\n")
            sys.stderr.flush()
    codes.append(code)

workers = [threading.Thread(target=run, args=(h,)) for h in hosts]
for t in workers:
    t.start()
for t in workers:
    t.join()
sys.exit(max(codes, default=0))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def two_hosts(tmp_path):
    """(hostfile, environment with the stub ssh and pdsh first on PATH, output folder)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("ssh", STUB_SSH), ("pdsh", STUB_PDSH.format(python=sys.executable))):
        stub = bin_dir / name
        stub.write_text(text)
        stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    hosts = tmp_path / "hosts"
    hosts.write_text("# two hosts, one rank each\nhostA slots=1\n\nhostB slots=1\n")
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", TRIDENT_TEST_EXPORTED="yes")
    return hosts, env, out


def _host_args(hosts: Path, launcher: str = "ssh") -> list[str]:
    return ["launch", "--hostfile", str(hosts), "--launcher", launcher, "--master-addr", "127.0.0.1",
            "--master-port", str(_free_port())]


def _job(stderr: str) -> str:
    return re.search(r"trident launch: job (trident-[0-9a-f]+)", stderr).group(1)


def _assert_nothing_left(job: str, out: Path) -> None:
    """No process of the job is left once the host agents' grace (5 s from SIGTERM to SIGKILL)
    has passed."""
    start = time.monotonic()
    while job_processes(job) and time.monotonic() < start + 15:
        time.sleep(0.1)
    print(f"the job's processes were gone {time.monotonic() - start:.1f} s after the launcher")
    assert job_processes(job) == [], f"processes of {job} outlived the launcher"
    for pid_file in out.glob("pid_rank*"):
        assert not Path(f"/proc/{pid_file.read_text()}").exists() or \
            "Z" in Path(f"/proc/{pid_file.read_text()}/stat").read_text().split()[2], pid_file.name


def _serial(steps: int):
    return train_serial(make_model(), [global_batch(s, 2) for s in range(steps)], "sgd", LR, clip=0.0)


def _check_trained_like_one_process(stdout: str, out: Path, steps: int) -> None:
    for host, rank in (("hostA", 0), ("hostB", 1)):
        assert re.search(rf"^\[{host}\] \[rank {rank}\] RESULT rank={rank} world=2 steps={steps} END$", stdout,
                         re.M), stdout[-3000:]
    losses = {}
    for rank, step, loss in re.findall(r"STEP rank=(\d) step=(\d+) loss=(\S+)", stdout):
        losses.setdefault(int(step), []).append(float(loss))
    ref = _serial(steps)
    # each rank's loss is its half of the global batch's; their mean is the global batch's loss
    assert_losses_close([sum(losses[s]) / 2 for s in range(steps)], ref.losses, rtol=1e-5)
    assert_state_close(torch.load(out / "weights.pt"), ref.weights, rtol=1e-5)


def test_two_hosts_from_a_hostfile_train_like_one_process(two_hosts):
    hosts, env, out = two_hosts
    proc = run_trident(_host_args(hosts) + [SCRIPT, "--out", str(out), "--steps", "4"], timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _check_trained_like_one_process(proc.stdout, out, 4)
    assert "2 rank(s) on 2 host(s) over ssh: hostA (node 0, slots 0), hostB (node 1, slots 0)" in proc.stderr
    _assert_nothing_left(_job(proc.stderr), out)


def test_killing_one_host_s_worker_ends_the_other_host_within_the_hang_bound(two_hosts):
    """rank 1 (hostB) gets SIGKILL mid-run: hostB's agent fails, the launcher ends hostA; the job
    is over well within the hang detector's timeout (which would end rank 0 otherwise), no
    process of the job is left, and the last lines name hostB's rank 1."""
    hosts, env, out = two_hosts
    hang_timeout = 10
    cmd = TRIDENT + _host_args(hosts) + [SCRIPT, "--out", str(out), "--steps", "1000", "--sleep", "0.1",
                                         "--timeout", str(hang_timeout)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (out / "pid_rank1").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (out / "pid_rank1").exists(), "rank 1 never started"
        time.sleep(1.0)
        os.kill(int((out / "pid_rank1").read_text()), signal.SIGKILL)
        killed = time.monotonic()
        stdout, stderr = proc.communicate(timeout=120)
        ended = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 1, stderr[-4000:]
    assert ended < hang_timeout + 5, f"the job took {ended:.1f} s to end after rank 1 was killed"
    assert "STEP rank=0" in stdout and "RESULT" not in stdout
    last = stderr.strip().splitlines()[-3:]
    assert last[0] == "trident launch: host hostB (node 1) failed first; ended the other host(s): hostA", last
    assert last[1].startswith("[hostB] trident launch: the job failed; first failure on global rank 1"), last
    assert last[2] == "[hostB] trident launch: rank 1: killed by signal 9 (SIGKILL)", last
    _assert_nothing_left(_job(stderr), out)


def _start_slow_job(hosts: Path, env: dict, out: Path, launcher: str = "ssh") -> subprocess.Popen:
    cmd = TRIDENT + _host_args(hosts, launcher) + [SCRIPT, "--out", str(out), "--steps", "1000", "--sleep", "0.1"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 180
    while not all((out / f"pid_rank{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    return proc


def test_a_killed_launcher_leaves_no_process_on_any_host(two_hosts):
    """SIGKILL to the launcher (no chance to clean up): the end of each ssh's input reaches the
    host agents, which end their hosts' processes."""
    hosts, env, out = two_hosts
    proc = _start_slow_job(hosts, env, out)
    os.kill(proc.pid, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=30)
    _assert_nothing_left(_job(stderr), out)


def test_ctrl_c_ends_every_host(two_hosts):
    hosts, env, out = two_hosts
    proc = _start_slow_job(hosts, env, out)
    os.kill(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == "trident launch: SIGINT: ended the job on every host"
    _assert_nothing_left(_job(stderr), out)


def test_pdsh_runs_every_host_in_one_command(two_hosts):
    hosts, env, out = two_hosts
    proc = run_trident(_host_args(hosts, "pdsh") + [SCRIPT, "--out", str(out), "--steps", "3"], timeout=240,
                       env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _check_trained_like_one_process(proc.stdout, out, 3)
    _assert_nothing_left(_job(proc.stderr), out)


def test_the_job_gets_the_exported_environment(two_hosts, tmp_path):
    """PYTHONPATH (this directory first), TRIDENT_* and a .deepspeed_env file's names reach every
    host's ranks; the stub's emptied environment has nothing else."""
    hosts, env, out = two_hosts
    (tmp_path / "job.env").write_text("# for every host\nFROM_ENV_FILE=one two\n\nNCCL_DEBUG=WARN\n")
    script = tmp_path / "show_env.py"
    script.write_text("import os\nnames = ('FROM_ENV_FILE', 'NCCL_DEBUG', 'TRIDENT_TEST_EXPORTED', 'HOSTNAME_SET')\n"
                      "print('ENV', os.environ['RANK'], {n: os.environ.get(n) for n in names}, "
                      "os.environ['PYTHONPATH'].split(':')[0], flush=True)\n")
    env = dict(env, DS_ENV_FILE=str(tmp_path / "job.env"), HOSTNAME_SET="not exported")
    proc = run_trident(_host_args(hosts) + [str(script)], timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = ("{'FROM_ENV_FILE': 'one two', 'NCCL_DEBUG': 'WARN', 'TRIDENT_TEST_EXPORTED': 'yes', "
                f"'HOSTNAME_SET': None}} {os.getcwd()}")
    for host, rank in (("hostA", 0), ("hostB", 1)):
        assert f"[{host}] [rank {rank}] ENV {rank} {expected}" in proc.stdout, proc.stdout[-3000:]


def test_dry_run_prints_each_host_s_command_and_starts_nothing(two_hosts):
    hosts, env, out = two_hosts
    proc = run_trident(_host_args(hosts) + ["--include", "hostB", "--dry-run", SCRIPT, "--out", str(out)],
                       timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert "1 rank(s) on 1 host(s) over ssh: hostB (node 0, slots 0)" in lines[0]
    assert lines[1] == "# hostB: node 0, slots 0"
    assert lines[2].startswith("ssh -o BatchMode=yes hostB 'cd ")
    assert "--host hostB" in lines[2] and "--nnodes 1 --master-addr 127.0.0.1" in lines[2]
    assert len(lines) == 3 and not list(out.iterdir())


def test_elastic_nodes_join_one_c10d_rendezvous():
    """`--nnodes 1:2` on two agents: torchrun's c10d rendezvous admits both; one world of 2."""
    port = str(_free_port())
    nodes = [subprocess.Popen(TRIDENT + ["launch", "--no-slurm", "--nnodes", "1:2", "--master-addr", "127.0.0.1",
                                         "--master-port", port, str(SCRIPTS / "dp_script.py")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for _ in range(2)]
    try:
        outs = [p.communicate(timeout=240) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert all(p.returncode == 0 for p in nodes), outs[0][1][-2000:] + outs[1][1][-2000:]
    results = re.findall(r"RESULT rank=(\d) world=(\d) dp=\d steps=\d checksum=(\S+) END", outs[0][0] + outs[1][0])
    assert sorted(r[0] for r in results) == ["0", "1"] and {r[1] for r in results} == {"2"}
    assert results[0][2] == results[1][2]


def test_an_unreachable_host_is_named(two_hosts):
    """ssh's own failure (exit code 255, nothing started there) ends the job with a hint."""
    hosts, env, out = two_hosts
    ssh = Path(env["PATH"].split(":")[0]) / "ssh"
    ssh.write_text('#!/bin/bash\necho "ssh: connect to host port 22: Connection refused" >&2\nexit 255\n')
    proc = run_trident(_host_args(hosts) + [SCRIPT, "--out", str(out)], timeout=60, env=env)
    assert proc.returncode == 1
    assert "[hostA] ssh: connect to host port 22: Connection refused" in proc.stderr
    assert re.fullmatch(r"trident launch: ssh could not run the command on (host[AB]) \(exit code 255\); check "
                        r"that `ssh -o BatchMode=yes \1 hostname` works without a password",
                        proc.stderr.strip().splitlines()[-1]), proc.stderr[-2000:]
