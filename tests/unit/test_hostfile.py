"""Hostfiles and DeepSpeed's --include / --exclude / --num_nodes / --num_gpus (no processes)."""

from __future__ import annotations

import shlex

import pytest

import trident.cli.main as cli_main
from trident.cli.hostagent import parse_slots, visible_devices
from trident.cli.hostfile import HostfileError, format_slots, parse_hostfile, parse_node_spec, select_slots
from trident.cli.multinode import Plan, first_failed_host, job_exports, read_env_file

HOSTFILE = """# the cluster
worker-0 slots=4
worker-1 slots=4   # the second node

   worker-2 slots=2 max_slots=8
"""


@pytest.fixture
def hosts():
    return parse_hostfile(HOSTFILE, "hosts.txt")


def test_hostfile_lines_comments_blank_lines_and_mpi_fields(hosts):
    assert [(h.name, h.slots, h.line) for h in hosts.values()] == [("worker-0", 4, 2), ("worker-1", 4, 3),
                                                                   ("worker-2", 2, 5)]
    assert select_slots(hosts) == {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3], "worker-2": [0, 1]}


@pytest.mark.parametrize("text,message", [
    ("a slots=2\nb slots=1\na slots=4\n", "hosts.txt:3: host 'a' is listed twice (first at line 1)"),
    ("a slots=2\nb\n", "hosts.txt:2: expected `HOSTNAME slots=N` (e.g. `worker-0 slots=8`), got 'b'"),
    ("a slots=two\n", "hosts.txt:1: expected `HOSTNAME slots=N`"),
    ("a slot=2\n", "hosts.txt:1: expected `HOSTNAME slots=N`"),
    ("a slots=2 extra\n", "hosts.txt:1: expected `HOSTNAME slots=N`"),
    ("a slots=0\n", "hosts.txt:1: host 'a' has slots=0"),
    ("# nothing\n\n", "hosts.txt: no hosts in it"),
])
def test_bad_hostfiles_name_the_file_and_line(text, message):
    with pytest.raises(HostfileError) as err:
        parse_hostfile(text, "hosts.txt")
    assert message in str(err.value)


def test_node_specs_as_deepspeed_reads_them():
    assert parse_node_spec("worker-0@worker-1:0,2") == {"worker-0": [], "worker-1": [0, 2]}
    assert parse_node_spec("a:2,0@a:1,2") == {"a": [0, 1, 2]}  # one host twice: the union, sorted
    for bad in ("a:", "a:x", "@a", "a:1:2", "a@@b"):
        with pytest.raises(HostfileError, match="--include"):
            parse_node_spec(bad)


def test_include_keeps_only_the_named_hosts_and_slots_in_hostfile_order(hosts):
    assert select_slots(hosts, include="worker-2@worker-0:1,3") == {"worker-0": [1, 3], "worker-2": [0, 1]}
    assert select_slots(hosts, include="worker-1") == {"worker-1": [0, 1, 2, 3]}


def test_exclude_drops_slots_or_whole_hosts(hosts):
    assert select_slots(hosts, exclude="worker-1:0,3@worker-2") == {"worker-0": [0, 1, 2, 3], "worker-1": [1, 2]}
    assert select_slots(hosts, exclude="worker-2:0,1") == {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}


def test_num_nodes_and_num_gpus_take_the_first_ones(hosts):
    assert select_slots(hosts, num_nodes=2) == {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}
    assert select_slots(hosts, num_gpus=2) == {"worker-0": [0, 1], "worker-1": [0, 1], "worker-2": [0, 1]}
    assert select_slots(hosts, num_nodes=1, num_gpus=1) == {"worker-0": [0]}


@pytest.mark.parametrize("kwargs,message", [
    ({"include": "worker-9"}, "--include 'worker-9': host 'worker-9' is not in the hostfile hosts.txt "
                              "(its hosts: worker-0, worker-1, worker-2)"),
    ({"exclude": "worker-9:0"}, "host 'worker-9' is not in the hostfile hosts.txt"),
    ({"include": "worker-2:2"}, "--include 'worker-2:2': slot 2 of host 'worker-2' is out of range: hosts.txt:5 "
                                "gives it slots=2 (slots 0..1)"),
    ({"exclude": "worker-0:7"}, "slot 7 of host 'worker-0' is out of range: hosts.txt:2"),
    ({"include": "worker-0", "exclude": "worker-1"}, "--include and --exclude are mutually exclusive"),
    ({"include": "worker-0", "num_gpus": 1}, "--num_nodes / --num_gpus do not go with --include / --exclude"),
    ({"exclude": "worker-0@worker-1@worker-2"}, "no slots are left to run on"),
    ({"num_nodes": 4}, "--num_nodes 4: the hostfile hosts.txt lists 3 host(s)"),
    ({"num_gpus": 3}, "--num_gpus 3: host 'worker-2' has slots=2 (hosts.txt:5)"),
])
def test_bad_filters_say_what_is_wrong(hosts, kwargs, message):
    with pytest.raises(HostfileError) as err:
        select_slots(hosts, **kwargs)
    assert message in str(err.value)


def test_slots_travel_to_the_hosts_and_become_their_visible_gpus():
    assert format_slots({"a": [1, 3], "b": [0]}) == "a:1,3@b:0"
    assert parse_slots("1,3@0") == [[1, 3], [0]]
    assert visible_devices([1, 3], {}) == "1,3"
    assert visible_devices([1, 3], {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == "5,7"  # slot i: the i-th visible
    with pytest.raises(SystemExit, match="slot 3 is out of range"):
        visible_devices([3], {"CUDA_VISIBLE_DEVICES": "0,1"})


def test_exports_follow_deepspeed_names_and_the_env_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / ".deepspeed_env").write_text("A=from home\nB=home\n")
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / ".deepspeed_env").write_text("# comment\n\nB=work $HOME\nexport C=x=y\n")
    environ = {"NCCL_IB_HCA": "mlx5", "PYTHONPATH": "/lib", "TRIDENT_X": "1", "UCX_TLS": "tcp", "MV2_X": "m",
               "MLFLOW_TRACKING_URI": "file:/r", "GLOO_SOCKET_IFNAME": "eth0", "HOME": str(tmp_path / "home"),
               "CUDA_VISIBLE_DEVICES": "0", "TRIDENT_LAUNCH_JOB": "old"}
    exports = job_exports(environ, str(tmp_path / "work"))
    assert exports == {"GLOO_SOCKET_IFNAME": "eth0", "MLFLOW_TRACKING_URI": "file:/r", "MV2_X": "m",
                       "NCCL_IB_HCA": "mlx5", "PYTHONPATH": f"{tmp_path / 'work'}:/lib", "TRIDENT_X": "1",
                       "UCX_TLS": "tcp", "A": '"from home"', "B": '"work $HOME"', "C": '"x=y"'}
    (tmp_path / "bad.env").write_text("GOOD=1\nnot a pair\n")
    with pytest.raises(SystemExit, match=r"bad.env:2: expected NAME=VALUE, got 'not a pair'"):
        read_env_file(str(tmp_path / "bad.env"))


def test_each_host_s_command_runs_the_host_agent_in_this_directory():
    plan = Plan(hosts={"a": [0, 1], "b": [1]}, launch_args=["--nnodes", "2", "train.py", "--lr", "1 e"],
                master="10.0.0.1:29500", job="trident-j", exports={"PYTHONPATH": "/w"}, cwd="/w", python="/py")
    command = plan.remote_command("b")
    assert command.startswith("cd /w && export PYTHONPATH=/w TRIDENT_LAUNCH_JOB=trident-j && exec /py -u ")
    words = shlex.split(command.split(" && exec ")[1])
    assert words[2].endswith("trident/cli/hostagent.py")
    assert words[3:] == ["--job", "trident-j", "--hosts", "a,b", "--slots", "0,1@1", "--host", "b", "--grace", "5",
                         "--watch-stdin", "--", "--nnodes", "2", "train.py", "--lr", "1 e"]
    assert plan.ssh_argv("b", command)[:4] == ["ssh", "-o", "BatchMode=yes", "b"]
    plan.launcher = "pdsh"
    assert plan.pdsh_argv(plan.remote_command("%h"))[:6] == ["pdsh", "-S", "-f", "1024", "-w", "a,b"]
    assert "--host %h --grace 5 --" in plan.remote_command("%h")  # no --watch-stdin: pdsh gives no input


def test_the_host_named_first_is_the_one_whose_launcher_names_a_cause():
    records = {"a": {"rank": 0, "cause": False, "time": 1.0}, "b": {"rank": 1, "cause": True, "time": 2.0}}
    assert first_failed_host({"a": 1, "b": 1}, records, observed="a") == "b"
    assert first_failed_host({"a": 1, "b": 143}, {"a": records["a"]}, observed="a") == "a"


def test_hostfile_errors_reach_the_command_line(tmp_path, capsys):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\nb slots=2\n")
    script = tmp_path / "train.py"
    script.write_text("")
    base = ["launch", "--hostfile", str(hostfile), "--master-addr", "h", "--dry-run"]
    with pytest.raises(SystemExit, match=r"trident launch: --include 'c': host 'c' is not in the hostfile"):
        cli_main.main(base + ["--include", "c", str(script)])
    with pytest.raises(SystemExit, match="--nproc does not go with --hostfile"):
        cli_main.main(base + ["--nproc", "2", str(script)])
    with pytest.raises(SystemExit, match="--nnodes N does not go with --hostfile"):
        cli_main.main(base + ["--nnodes", "2", str(script)])
    assert cli_main.main(base + ["--launcher", "ssh", "--exclude", "a:0@b:1", str(script)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "2 rank(s) on 2 host(s) over ssh: a (node 0, slots 1), b (node 1, slots 0); master h:29500" in out[0]
    assert out[1] == "# a: node 0, slots 1" and out[3] == "# b: node 1, slots 0"


def test_a_hostfile_of_this_machine_alone_runs_here(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=4\n")
    script = tmp_path / "train.py"
    script.write_text("")
    assert cli_main.main(["launch", "--hostfile", str(hostfile), "--include", "localhost:1,2", "--dry-run",
                          str(script)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("CUDA_VISIBLE_DEVICES=1,2 ") and "--nproc-per-node=2" in line and "--standalone" in line
