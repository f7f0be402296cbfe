"""A SLURM allocation, read from the environment `trident launch` runs in.

Inside a job step (`srun trident launch ...`, one task per node) every node's launcher reads
its place from SLURM: the nodes (`SLURM_STEP_NODELIST`, else `SLURM_JOB_NODELIST`, expanded
from SLURM's compressed form `node[01-03,07]`), this node's index (the position of
`SLURMD_NODENAME` in that list, else `SLURM_NODEID`) and the GPUs on it
(`SLURM_GPUS_ON_NODE`). Node 0 is the master; the port comes from the job id, so that two jobs
sharing a node do not collide. In an allocation but outside a step (the batch script itself,
or an `salloc` shell) a multi-node job is started as `srun --nodes=N --ntasks-per-node=1
--kill-on-bad-exit=1 trident launch ...`, which lands in the first case on every node.
"""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
from dataclasses import dataclass

_GROUP = re.compile(r"\[([^\[\]]*)\]")


class SlurmError(ValueError):
    """An allocation's environment that `trident launch` cannot use; the message says why."""


def expand_nodelist(text: str) -> list[str]:
    """`node[01-03,07],gpu5` -> [node01, node02, node03, node07, gpu5]: SLURM's hostlist form,
    with several bracket groups in one name (`rack[1-2]-n[1-2]`, every combination in order) and
    zero padding kept from the range's start (`[08-10]` -> 08, 09, 10)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise SlurmError(f"node list {text!r}: nested brackets")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SlurmError(f"node list {text!r}: ']' without '['")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise SlurmError(f"node list {text!r}: '[' without ']'")
    items.append(text[start:])
    nodes: list[str] = []
    for item in (i.strip() for i in items):
        if not item:
            raise SlurmError(f"node list {text!r}: an empty name")
        pieces = _GROUP.split(item)  # literal, group, literal, group, ..., literal
        if "[" in "".join(pieces[0::2]) or "]" in "".join(pieces[0::2]):
            raise SlurmError(f"node list {text!r}: unmatched bracket in {item!r}")
        choices = [[p] if k % 2 == 0 else _expand_group(p, text) for k, p in enumerate(pieces)]
        nodes += ["".join(parts) for parts in itertools.product(*choices)]
    return nodes


def _expand_group(group: str, text: str) -> list[str]:
    out = []
    for rng in group.split(","):
        lo, sep, hi = rng.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise SlurmError(f"node list {text!r}: {rng!r} is not a number or a range like 01-04")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise SlurmError(f"node list {text!r}: range {rng!r} runs backwards")
        width = len(lo)
        out += [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
    return out


def scontrol_hostnames(text: str) -> list[str] | None:
    """`scontrol show hostnames TEXT`, where scontrol is installed; None otherwise."""
    if shutil.which("scontrol") is None:
        return None
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", text], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.split() or None


@dataclass(frozen=True)
class Allocation:
    """What SLURM says about the job this process runs in."""

    job_id: str
    nodes: tuple[str, ...]
    node_rank: int
    gpus_on_node: int | None
    in_step: bool
    step_tasks: int | None

    @property
    def nnodes(self) -> int:
        return len(self.nodes)

    @property
    def master_addr(self) -> str:
        return self.nodes[0]

    @property
    def master_port(self) -> int:
        """A port in 20000..29999 from the job id: the same on every node of the job, and unlike
        a neighbouring job's (jobs sharing a node would collide on torchrun's fixed 29500)."""
        digits = re.sub(r"\D", "", self.job_id)
        return 20000 + int(digits) % 10000 if digits else 29500


def _int(env: dict, name: str) -> int | None:
    value = env.get(name, "").strip()
    if not value:
        return None
    match = re.match(r"^(\d+)", value)  # SLURM_GPUS_ON_NODE can read "4(x2)" on some versions
    if match is None:
        raise SlurmError(f"{name}={value!r} is not a number")
    return int(match.group(1))


def allocation(env: dict) -> Allocation | None:
    """The allocation described by `env` (os.environ), or None outside SLURM."""
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    in_step = bool(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID"))
    names = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if in_step else \
        ("SLURM_JOB_NODELIST", "SLURM_NODELIST")
    source = next((n for n in names if env.get(n)), None)
    if job_id is None and source is None:
        return None
    if source is None:
        raise SlurmError(f"SLURM job {job_id}: SLURM_JOB_NODELIST is not set, so the nodes are unknown")
    text = env[source]
    try:
        nodes = expand_nodelist(text)
    except SlurmError:
        nodes = scontrol_hostnames(text)
        if nodes is None:
            raise
    counts = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES") if source.startswith("SLURM_STEP") \
        else ("SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    count_name = next((n for n in counts if env.get(n)), None)
    if count_name is not None and _int(env, count_name) != len(nodes):
        raise SlurmError(f"{source}={text!r} names {len(nodes)} node(s) but {count_name}={env[count_name]}")
    here = env.get("SLURMD_NODENAME")
    if here and here in nodes:
        rank = nodes.index(here)
    else:
        rank = _int(env, "SLURM_NODEID")
        if rank is None:
            rank = 0 if len(nodes) == 1 else None
        if rank is None or not 0 <= rank < len(nodes):
            raise SlurmError(f"cannot tell which of the {len(nodes)} nodes of {source}={text!r} this is: "
                             f"SLURMD_NODENAME={here!r}, SLURM_NODEID={env.get('SLURM_NODEID')!r}")
    step_tasks = _int(env, "SLURM_STEP_NUM_TASKS") if in_step else None
    if in_step and step_tasks is None:
        step_tasks = _int(env, "SLURM_NTASKS")
    return Allocation(job_id=job_id or "0", nodes=tuple(nodes), node_rank=rank,
                      gpus_on_node=_int(env, "SLURM_GPUS_ON_NODE"), in_step=in_step, step_tasks=step_tasks)


def check_one_task_per_node(alloc: Allocation) -> None:
    """A step must run one `trident launch` a node: torchrun's agent starts that node's ranks."""
    if alloc.in_step and alloc.step_tasks is not None and alloc.step_tasks > alloc.nnodes:
        raise SlurmError(f"this job step runs {alloc.step_tasks} tasks on {alloc.nnodes} node(s); run one "
                         "`trident launch` per node (`srun --ntasks-per-node=1 trident launch --nproc G ...`), "
                         "which starts that node's G ranks itself")


def srun_argv(alloc: Allocation, command: list[str]) -> list[str]:
    """The srun command that runs `command` once on every node of the allocation; one task's
    failure ends the others (--kill-on-bad-exit), and every line is labelled with its node."""
    return ["srun", f"--nodes={alloc.nnodes}", f"--ntasks={alloc.nnodes}", "--ntasks-per-node=1",
            "--kill-on-bad-exit=1", "--label", *command]
