"""Parameter-server checkpoints: one file per server plus the workers' counters.

    save_dir/
      latest                     the newest tag, as DeepSpeed writes it
      <tag>/ps_server_<s>.pt     server s's parameters, optimizer state (both by parameter
                                 name), param-group hyper-parameters, schedule, version, clock
      <tag>/ps_workers.pt        steps, samples and the client_state of worker 0

Keyed by name, the server files load into any number of servers and any placement: each server
reads every file and takes the tensors it now owns. Writes go to a temporary name first, so a
crash mid-save never leaves a truncated file under the final name.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from trident.parameter_server.shard import CHECKPOINT_FORMAT

if TYPE_CHECKING:
    from trident.parameter_server.shard import ShardState

WORKERS_FILE = "ps_workers.pt"
LOAD_OPTIMIZER, LOAD_SCHEDULER, MODULE_ONLY = 1, 2, 4


def _atomic_save(obj: object, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def shard_file(folder: Path, server: int) -> Path:
    return Path(folder) / f"ps_server_{server}.pt"


def write_shard(folder: Path, server: int, state: dict) -> None:
    _atomic_save(state, shard_file(folder, server))


def read_shards(folder: Path) -> list[dict]:
    """Every server file of a checkpoint folder, in server order."""
    files = sorted(Path(folder).glob("ps_server_*.pt"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))
    if not files:
        raise FileNotFoundError(f"{folder} holds no parameter-server files (ps_server_<s>.pt); pass the folder "
                                "engine.save_checkpoint wrote under parameter_server, or a tag of it")
    states = [torch.load(f, map_location="cpu", weights_only=False) for f in files]
    for f, s in zip(files, states):
        if s.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{f} is not a parameter-server checkpoint file (format {s.get('format')!r}, expected "
                             f"{CHECKPOINT_FORMAT!r})")
    expected = states[0]["servers"]
    if len(states) != expected:
        raise ValueError(f"{folder} holds {len(states)} server files but was written by {expected} servers; the "
                         "checkpoint is incomplete (a save was interrupted?); load an earlier tag")
    return states


def load_shard(shard: ShardState, folder: Path, server: int, flags: int) -> None:
    shard.load(read_shards(folder), server, load_optimizer=bool(flags & LOAD_OPTIMIZER),
               load_scheduler=bool(flags & LOAD_SCHEDULER), module_only=bool(flags & MODULE_ONLY))


def write_workers(folder: Path, state: dict) -> None:
    _atomic_save(state, Path(folder) / WORKERS_FILE)


def read_workers(folder: Path) -> dict:
    return torch.load(Path(folder) / WORKERS_FILE, map_location="cpu", weights_only=False)


def write_latest(save_dir: Path, tag: str) -> None:
    path = Path(save_dir) / "latest"
    tmp = path.with_name(".latest.tmp")
    tmp.write_text(tag)
    os.replace(tmp, path)


def resolve_folder(load_dir: str | Path, tag: str | None) -> Path | None:
    """save_dir/tag, or save_dir/<latest>; None when there is no checkpoint yet."""
    load_dir = Path(load_dir)
    if tag is None:
        latest = load_dir / "latest"
        if not latest.exists():
            return None
        tag = latest.read_text().strip()
    folder = load_dir / tag
    if not (folder / WORKERS_FILE).exists():
        raise FileNotFoundError(f"{folder} is not a complete parameter-server checkpoint (no {WORKERS_FILE}); "
                                f"pick a tag that engine.save_checkpoint finished writing")
    return folder
