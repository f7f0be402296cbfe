"""Preflight: before training, every rank checks that it is in the job it thinks it is in.

Ranks started with different configs (a stale file on one node, a different override) build
different meshes and then wait for each other forever in mismatched collectives. Preflight
compares what every rank sees and turns a mismatch into one line:

- `run_preflight(cfg)` (no mesh yet, right after the process group starts): through the
  rendezvous store, not a collective, so it works even when the ranks would build different
  meshes; compares the config's hash, the world size and the torch / trident versions.
- `run_preflight(cfg, mesh)`: one all-gather over the mesh compares the same facts plus the
  layout (pp, dp, cp, ep, tp), and a tiny all-reduce on every axis group in use checks that
  each group works.
"""

from __future__ import annotations

import hashlib
import time

import torch
import torch.distributed as dist

from trident.parallel.topology import AXIS_ORDER
from trident.reliability.channel import Channel
from trident.reliability.failures import OneLineError
from trident.version import __version__

_FIELDS = ("world size", "config", "torch version", "trident version", "layout (pp, dp, cp, ep, tp)")
_rounds: dict[tuple, int] = {}


class PreflightError(OneLineError):
    """The ranks disagree about the job (config, world size, layout) or a group does not work."""


def config_hash(cfg) -> str:
    """sha256 of the resolved config: equal on two ranks iff they resolved the same settings."""
    return hashlib.sha256(cfg.resolved_json(indent=None).encode()).hexdigest()


def _facts(cfg, layout: tuple[int, ...] | None) -> list:
    return [dist.get_world_size(), config_hash(cfg)[:15], torch.__version__, __version__,
            list(layout) if layout is not None else None]


def _first_mismatch(seen: dict[int, list], quiet: bool) -> None:
    """Raise a one-line PreflightError naming the first fact the ranks disagree on."""
    for i, name in enumerate(_FIELDS):
        groups: dict[str, list[int]] = {}
        for rank, facts in sorted(seen.items()):
            groups.setdefault(str(facts[i]), []).append(rank)
        if len(groups) > 1:
            views = "; ".join(f"{_who(ranks)} {value}" for value, ranks in groups.items())
            advice = ("start every rank with the same config (same file, same overrides)" if name == "config"
                      else "start every rank from the same installation and launch command")
            raise PreflightError(f"trident preflight: the ranks disagree on the {name}: {views}; {advice}",
                                 quiet=quiet)


def _who(ranks: list[int]) -> str:
    """'rank 1 sees' or 'ranks 0, 2 see'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]} sees"
    return f"ranks {', '.join(map(str, ranks))} see"


def run_preflight(cfg, mesh=None) -> None:
    """See the module docstring. Collective over the world (no mesh) or over the mesh."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    if mesh is None:
        _through_store(cfg)
    else:
        _through_mesh(cfg, mesh)


def _through_store(cfg) -> None:
    channel = Channel.open()
    if channel is None:
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    members = tuple(range(world))
    _rounds[members] = _rounds.get(members, 0) + 1
    prefix = f"preflight/{_rounds[members]}"
    channel.put(f"{prefix}/{rank}", _facts(cfg, None))
    timeout = cfg.distributed.timeout_s
    seen = channel.collect({r: f"{prefix}/{r}" for r in members}, time.monotonic() + timeout)
    missing = [r for r in members if r not in seen]
    quiet = rank != min(seen)
    if missing:
        raise PreflightError(f"trident preflight: rank(s) {', '.join(map(str, missing))} of {world} did not "
                             f"start within distributed.timeout_s = {timeout:g} s; check that every rank "
                             f"was launched and could import the training script", quiet=quiet)
    _first_mismatch(seen, quiet)


def _through_mesh(cfg, mesh) -> None:
    layout = tuple(mesh.topology.size(axis) for axis in AXIS_ORDER)
    facts = _facts(cfg, layout)
    from trident.comm import collectives

    gathered: list = [None] * mesh.world_size
    collectives.all_gather_object(gathered, facts, group=mesh.mesh_group)
    quiet = mesh.mesh_rank != 0
    _first_mismatch({mesh.ranks[i]: f for i, f in enumerate(gathered)}, quiet)
    device = torch.device(mesh.device_mesh.device_type)
    for axis in AXIS_ORDER:  # every axis group in use, cp and ep included
        size = mesh.topology.size(axis)
        if size == 1:
            continue
        probe = torch.ones(1, device=device)
        collectives.all_reduce(probe, group=mesh.group(axis))
        if probe.item() != size:
            raise PreflightError(f"trident preflight: a test all-reduce of ones over this rank's {axis} group "
                                 f"{mesh.group_ranks(axis)} returned {probe.item():g} instead of {size}; the "
                                 f"{axis} process group is broken (check the network interfaces and the backend)",
                                 quiet=quiet)
