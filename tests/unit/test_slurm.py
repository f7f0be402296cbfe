"""`trident launch` inside a SLURM allocation: the environment of a 2-node job, set here, gives
--nnodes, --node-rank, the master address and the ranks per node (no processes)."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
from pathlib import Path

import pytest

import trident.cli.main as cli_main
from trident.cli.placement import apply_allocation
from trident.cli.slurm import SlurmError, allocation, expand_nodelist

SLURM_VARS = ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_NNODES",
              "SLURM_JOB_NUM_NODES", "SLURM_NODEID", "SLURM_GPUS_ON_NODE", "SLURMD_NODENAME", "SLURM_STEP_ID",
              "SLURM_STEPID", "SLURM_STEP_NODELIST", "SLURM_STEP_NUM_NODES", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS",
              "CUDA_VISIBLE_DEVICES")


def two_node_step(node: int, **extra) -> dict:
    """What srun --nodes=2 --ntasks-per-node=1 sets on node `node` of job 4242 (4 GPUs a node)."""
    names = ["gpu-a07", "gpu-a08"]
    return {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu-a[07-08]", "SLURM_NNODES": "2",
            "SLURM_NODEID": str(node), "SLURM_GPUS_ON_NODE": "4", "SLURMD_NODENAME": names[node],
            "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "gpu-a[07-08]", "SLURM_STEP_NUM_NODES": "2",
            "SLURM_STEP_NUM_TASKS": "2", **extra}


@pytest.fixture
def slurm_env(monkeypatch):
    for name in SLURM_VARS:
        monkeypatch.delenv(name, raising=False)

    def set_env(env: dict) -> None:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
    return set_env


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


@pytest.mark.parametrize("text,nodes", [
    ("node01", ["node01"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("node[08-10],login1", ["node08", "node09", "node10", "login1"]),
    ("a[1-2]-b[3,5]", ["a1-b3", "a1-b5", "a2-b3", "a2-b5"]),
    ("gpu[9-11]", ["gpu9", "gpu10", "gpu11"]),
    ("x[001-002]y", ["x001y", "x002y"]),
])
def test_compressed_node_lists_expand(text, nodes):
    assert expand_nodelist(text) == nodes


@pytest.mark.parametrize("text", ["node[01-03", "node01]", "node[a-b]", "node[3-1]", "a,,b", "n[[1]]"])
def test_malformed_node_lists_are_errors(text):
    with pytest.raises(SlurmError, match="node list"):
        expand_nodelist(text)


def test_a_two_node_allocation_gives_nnodes_node_rank_and_master():
    for node in (0, 1):
        alloc = allocation(two_node_step(node))
        assert alloc.nodes == ("gpu-a07", "gpu-a08") and alloc.nnodes == 2 and alloc.node_rank == node
        assert alloc.master_addr == "gpu-a07" and alloc.gpus_on_node == 4 and alloc.in_step
        assert alloc.master_port == 20000 + 4242  # from the job id: the same on both nodes
        args = argparse.Namespace(nnodes=None, node_rank=None, master_addr=None, master_port=None, nproc=None,
                                  rdzv_id=None)
        apply_allocation(args, alloc)
        assert (args.nnodes, args.node_rank, args.master_addr, args.master_port, args.nproc, args.rdzv_id) == \
            ("2", node, "gpu-a07", 24242, 4, "slurm-4242")


def test_the_node_rank_comes_from_slurm_nodeid_without_a_node_name():
    env = two_node_step(1)
    del env["SLURMD_NODENAME"]
    assert allocation(env).node_rank == 1
    assert allocation({}) is None  # not in SLURM


def test_flags_on_the_command_line_win():
    args = argparse.Namespace(nnodes=None, node_rank=None, master_addr="10.1.1.1", master_port=6000, nproc=2,
                              rdzv_id=None)
    apply_allocation(args, allocation(two_node_step(1)))
    assert (args.nnodes, args.node_rank, args.master_addr, args.master_port, args.nproc) == ("2", 1, "10.1.1.1",
                                                                                           6000, 2)


def test_inconsistent_allocations_are_errors():
    with pytest.raises(SlurmError, match=r"names 2 node\(s\) but SLURM_STEP_NUM_NODES=3"):
        allocation(two_node_step(0, SLURM_STEP_NUM_NODES="3"))
    env = two_node_step(0, SLURMD_NODENAME="elsewhere", SLURM_NODEID="5")
    with pytest.raises(SlurmError, match="cannot tell which of the 2 nodes"):
        allocation(env)


def test_dry_run_inside_a_job_step(slurm_env, script, capsys):
    slurm_env(two_node_step(1))
    assert cli_main.main(["launch", "--dry-run", script]) == 0
    captured = capsys.readouterr()
    assert "SLURM job 4242: node 1 of 2 (gpu-a08), 4 rank(s) here; master gpu-a07:24242" in captured.err
    line = captured.out.strip()
    for flag in ("--nproc-per-node=4", "--nnodes=2", "--node-rank=1", "--master-addr=gpu-a07",
                 "--master-port=24242", "--tee=3"):
        assert f" {flag} " in line, line


def test_the_elastic_form_uses_c10d_at_the_first_node(slurm_env, script, capsys):
    slurm_env(two_node_step(0))
    assert cli_main.main(["launch", "--dry-run", "--nnodes", "1:2", "--max-restarts", "3", script]) == 0
    line = capsys.readouterr().out
    assert re.search(r" --nnodes=1:2 --rdzv-backend=c10d --rdzv-endpoint=gpu-a07:24242 --rdzv-id=slurm-4242 ", line)
    assert "--node-rank" not in line and "--max-restarts=3" in line


def test_a_batch_script_starts_one_launcher_per_node_with_srun(slurm_env, script, capsys):
    env = two_node_step(0)
    for name in ("SLURM_STEP_ID", "SLURM_STEP_NODELIST", "SLURM_STEP_NUM_NODES", "SLURM_STEP_NUM_TASKS"):
        del env[name]
    slurm_env(env)
    assert cli_main.main(["launch", "--dry-run", script, "--lr", "0.1"]) == 0
    err = capsys.readouterr().err
    assert "SLURM job 4242 has 2 nodes and this is not a job step; starting one launcher per node:" in err
    srun = err.strip().splitlines()[-1]
    assert srun.startswith("srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1 --label ")
    assert srun.endswith(f"-m trident.cli.main launch --dry-run {script} --lr 0.1")


def test_one_launcher_per_node(slurm_env, script):
    slurm_env(two_node_step(0, SLURM_STEP_NUM_TASKS="8"))
    with pytest.raises(SystemExit, match=r"runs 8 tasks on 2 node\(s\); run one `trident launch` per node"):
        cli_main.main(["launch", "--dry-run", script])


def test_no_slurm_ignores_the_allocation(slurm_env, script, capsys):
    slurm_env(two_node_step(1))
    assert cli_main.main(["launch", "--no-slurm", "--dry-run", script]) == 0
    assert "--standalone" in capsys.readouterr().out


def test_the_sbatch_template_is_a_working_job(slurm_env, capsys):
    """examples/slurm.sbatch: valid bash, one task per node, and its srun line's trident command
    accepted as it would run on node 1 of the 2-node allocation it asks for."""
    path = Path(__file__).resolve().parents[2] / "examples" / "slurm.sbatch"
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    text = path.read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --ntasks-per-node=1" in text
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    words = shlex.split(srun.replace("${SLURM_JOB_ID}", "4242"))
    command = words[words.index("trident") + 1:]
    slurm_env(two_node_step(1, SLURM_GPUS_ON_NODE="8"))
    assert cli_main.main(command + ["--dry-run"]) == 0
    line = capsys.readouterr().out
    assert " --nproc-per-node=8 " in line and " --nnodes=2 --node-rank=1 --master-addr=gpu-a07 " in line
    assert " -m trident.cli.worker -m trident.trainer --config " in line
    assert line.rstrip().endswith(" --run-name slurm-4242")
