"""Process-group start-up from torchrun's environment.

This is the one place in trident that reads environment variables: torchrun (and `trident
launch`) describe each process with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT.
With none of them set, the script was started as a plain `python train.py`, and trident runs a
world of one process so the same script works unchanged.
"""

from __future__ import annotations

import atexit
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist

ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class DistEnv:
    """What this process is in the job: its ranks, the backend and the device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device


def default_device(backend: str) -> torch.device:
    """The device collectives of `backend` work on: the current CUDA device for NCCL, else CPU."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def launch_env(environ: Mapping[str, str]) -> dict[str, int | str] | None:
    """RANK, WORLD_SIZE, LOCAL_RANK (as ints), MASTER_ADDR and MASTER_PORT from `environ`.

    None when none of them is set (a plain single-process run); an error when only some are,
    since that is a half-configured launch that would otherwise hang or pick wrong ranks.
    """
    present = [k for k in ENV_VARS if k in environ]
    if not present:
        return None
    missing = [k for k in ENV_VARS if k not in environ]
    if missing:
        raise RuntimeError(
            f"distributed environment incomplete: {', '.join(present)} set but {', '.join(missing)} "
            f"missing; start multi-process runs with `trident launch` or torchrun, which set all of "
            f"{', '.join(ENV_VARS)}, or unset them all for a single-process run")
    env: dict[str, int | str] = {"MASTER_ADDR": environ["MASTER_ADDR"]}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        try:
            env[key] = int(environ[key])
        except ValueError:
            raise RuntimeError(f"environment variable {key}={environ[key]!r} is not an integer; "
                               f"it is set by torchrun / `trident launch`, check how the job was started") from None
    if not 0 <= env["RANK"] < env["WORLD_SIZE"]:
        raise RuntimeError(f"RANK={env['RANK']} must be in [0, WORLD_SIZE={env['WORLD_SIZE']})")
    return env


def choose_backend(backend: str | None) -> str:
    """NCCL when CUDA is present, else gloo; an explicit choice must be usable here."""
    if backend is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)} (or None to choose by device), "
                         f"got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs CUDA, and torch.cuda.is_available() is False here; "
                         "use backend='gloo' (or None) to run on CPU")
    return backend


def _current_env() -> DistEnv:
    backend = str(dist.get_backend())
    rank = dist.get_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    return DistEnv(rank=rank, world_size=dist.get_world_size(), local_rank=local_rank,
                   backend=backend, device=default_device(backend))


# How long exit waits for gloo's worker threads to let go of finished collectives.
_EXIT_SETTLE_S = 0.05


def _shutdown() -> None:
    """Tear the process groups down before the interpreter finalises.

    gloo's worker threads drop their last references to finished collectives (and so to
    Python-owned tensors) a moment after the collective completes. If that happens while the
    interpreter is finalising, the thread cannot take the GIL and the process aborts with
    "terminate called without an active exception": a clean run reported as SIGABRT. So
    shut the groups down and give those threads a moment while the interpreter is alive.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
        time.sleep(_EXIT_SETTLE_S)


def _init_from_url(backend: str, init_method: str, rank: int, world_size: int, timeout_s: float) -> DistEnv:
    """A file:// or tcp:// rendezvous; the rank and world size come from the call or the environment."""
    if not str(init_method).startswith(("file://", "tcp://")):
        raise ValueError(f"init_method must be 'env://', 'file://<path>' or 'tcp://<host>:<port>', got {init_method!r}")
    rank = rank if rank >= 0 else int(os.environ.get("RANK", -1))
    world_size = world_size if world_size > 0 else int(os.environ.get("WORLD_SIZE", -1))
    if rank < 0 or world_size <= 0:
        raise ValueError(f"init_method={init_method!r} needs rank= and world_size= (or RANK / WORLD_SIZE set)")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    atexit.register(_shutdown)
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, backend=backend,
                   device=default_device(backend))


def init_distributed(backend: str | None = None, timeout_s: float = 1800.0, init_method: str | None = None,
                     rank: int = -1, world_size: int = -1) -> DistEnv:
    """Start the default process group once, from torchrun's environment, and describe it.

    Returns the existing group's description when torch.distributed is already initialised.
    `timeout_s` bounds how long any collective waits for the other ranks. `init_method`
    "file://..." or "tcp://..." is a rendezvous torch.distributed takes as it is, with `rank` /
    `world_size` given or read from RANK / WORLD_SIZE (for jobs not started by a launcher).
    """
    if init_method not in (None, "env://") and not dist.is_initialized():
        return _init_from_url(choose_backend(backend), init_method, rank, world_size, timeout_s)
    if dist.is_initialized():
        return _current_env()
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
    env = launch_env(os.environ)
    backend = choose_backend(backend)
    timeout = timedelta(seconds=timeout_s)
    if env is None:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return DistEnv(rank=0, world_size=1, local_rank=0, backend=backend, device=default_device(backend))
    if backend == "nccl":
        torch.cuda.set_device(env["LOCAL_RANK"])
    dist.init_process_group(backend, init_method="env://", rank=env["RANK"],
                            world_size=env["WORLD_SIZE"], timeout=timeout)
    atexit.register(_shutdown)
    return DistEnv(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                   local_rank=int(env["LOCAL_RANK"]), backend=backend, device=default_device(backend))
