"""The process groups of a parallel layout over the named axes pp, dp, cp, ep, tp, built on torch's
DeviceMesh.

A `ParallelMesh` is created once and handed to whatever needs a group: nothing in trident
keeps groups in module globals, so two meshes (two engines, or a parallel run next to its
serial reference in a test) live side by side in one process. Every process group trident
uses comes from the mesh (`group`, `gradient_group`, `subgroup`), so group creation, which is
collective and must happen in the same order on every rank, lives in one place and is cached.

The DeviceMesh always has all five axes (`AXIS_ORDER`), size-1 axes included, so the group of
every axis exists whatever the layout. A group over several axes (`group("dp", "cp")`) is the
same group whichever order the axes are named in; axes of size 1 add nothing to it, so with
cp = 1 `group("dp", "cp")` *is* the dp group.

Vocabulary: the *global rank* is a process's rank in the default process group (what
`dist.get_rank()` returns, and what torch's group-membership lists hold); the *mesh rank* is
its position in this mesh, from which its coordinates follow (`Topology.coords`). They are
equal for a mesh over the whole world, and differ for `ParallelMesh.solo()`.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trident.parallel.topology import AXES, AXIS_ORDER, Coord, Topology

DENSE_GRADIENT_AXES = ("dp", "cp", "ep")
"""Axes over which an ordinary (dense) weight is replicated, so its gradient is reduced over them.

trident's ep is an axis of its own, not carved out of dp: ranks at different ep coordinates
see different data and hold different experts. A dense weight is therefore the same on every
rank of a dp x cp x ep group (cp ranks see other parts of the same sequences), and each of
those ranks contributes a share of its gradient."""

EXPERT_GRADIENT_AXES = ("dp", "cp")
"""Axes over which an expert weight (`param.expert_parallel = True`) is replicated: ranks at
other ep coordinates hold other experts, so expert gradients are reduced over dp x cp only."""


class ParallelMesh:
    """Process groups and this process's coordinates along the pp, dp, cp, ep and tp axes."""

    def __init__(self, device_mesh: DeviceMesh, mesh_group: dist.ProcessGroup | None = None) -> None:
        if tuple(device_mesh.mesh_dim_names or ()) != AXIS_ORDER:
            raise ValueError(f"ParallelMesh needs a {len(AXIS_ORDER)}-D DeviceMesh with mesh_dim_names="
                             f"{AXIS_ORDER}, got {device_mesh.mesh_dim_names}; build one with ParallelMesh.build()")
        self.device_mesh = device_mesh
        self.topology = Topology(**{a: int(s) for a, s in zip(AXIS_ORDER, device_mesh.mesh.shape)})
        self.ranks: list[int] = [int(r) for r in device_mesh.mesh.flatten().tolist()]
        self.global_rank = dist.get_rank()
        if self.global_rank not in self.ranks:
            raise ValueError(f"global rank {self.global_rank} is not in this DeviceMesh (ranks {self.ranks})")
        self.mesh_rank = self.ranks.index(self.global_rank)
        self.coords: Coord = self.topology.coords(self.mesh_rank)
        self._groups: dict[tuple[str, ...], dist.ProcessGroup] = {
            (axis,): device_mesh.get_group(axis) for axis in AXIS_ORDER}
        self._subgroups: dict[tuple, dist.ProcessGroup | None] = {}
        if mesh_group is None:
            if len(self.ranks) != dist.get_world_size():
                raise ValueError("a ParallelMesh over part of the world needs mesh_group= (a process group "
                                 f"of exactly its ranks {self.ranks})")
            mesh_group = dist.group.WORLD
        self.mesh_group = mesh_group  # every rank of this mesh, for mesh-wide barriers and agreement
        # Created now, not on first use: ranks may hold different kinds of parameters (a pipeline
        # stage without experts), and a lazily created group would hang the ranks that ask.
        for axes in (DENSE_GRADIENT_AXES, EXPERT_GRADIENT_AXES):
            self.group(*axes)

    @classmethod
    def build(cls, pp: int = 1, tp: int = 1, dp: int | None = None, device_type: str = "cpu", *,
              cp: int = 1, ep: int = 1) -> ParallelMesh:
        """The mesh over every rank of the default group; dp defaults to the rest of the world.

        Collective: every rank calls it, with the same arguments, in the same order as its
        other group creations.
        """
        if not dist.is_initialized():
            raise RuntimeError("ParallelMesh.build needs torch.distributed initialised: call "
                               "trident.comm.init_distributed() first")
        world = dist.get_world_size()
        if dp is None:
            topology = Topology.for_world(world, pp=pp, tp=tp, cp=cp, ep=ep)
        else:
            topology = Topology(pp=pp, dp=dp, tp=tp, cp=cp, ep=ep)
            if topology.world_size != world:
                shown = _shown_axes(topology)
                raise ValueError(f"{' * '.join(shown)} = {' * '.join(str(topology.size(a)) for a in shown)} = "
                                 f"{topology.world_size}, but the world has {world} ranks; choose sizes whose "
                                 f"product is {world}, or leave dp=None to derive it")
        shape = tuple(topology.size(a) for a in AXIS_ORDER)
        return cls(init_device_mesh(device_type, shape, mesh_dim_names=AXIS_ORDER))

    @classmethod
    def solo(cls, device_type: str = "cpu") -> ParallelMesh:
        """A mesh of this rank alone (every axis of size 1), e.g. to run a serial reference.

        Collective: every rank of the world calls it, and each gets its own one-rank mesh.
        """
        if not dist.is_initialized():
            raise RuntimeError("ParallelMesh.solo needs torch.distributed initialised: call "
                               "trident.comm.init_distributed() first")
        me = dist.get_rank()
        mine = None
        for rank in range(dist.get_world_size()):  # new_group is collective over the world
            group = dist.new_group([rank])
            if rank == me:
                mine = group
        device_mesh = DeviceMesh.from_group([mine] * len(AXIS_ORDER), device_type,
                                            mesh=torch.tensor(me).reshape((1,) * len(AXIS_ORDER)),
                                            mesh_dim_names=AXIS_ORDER)
        return cls(device_mesh, mesh_group=mine)

    # -- sizes, coordinates, groups per axis -------------------------------------------------

    @property
    def world_size(self) -> int:
        """Number of ranks in this mesh."""
        return self.topology.world_size

    @property
    def pp_size(self) -> int:
        return self.topology.pp

    @property
    def dp_size(self) -> int:
        return self.topology.dp

    @property
    def cp_size(self) -> int:
        return self.topology.cp

    @property
    def ep_size(self) -> int:
        return self.topology.ep

    @property
    def tp_size(self) -> int:
        return self.topology.tp

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def cp_rank(self) -> int:
        return self.coords.cp

    @property
    def ep_rank(self) -> int:
        return self.coords.ep

    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self._groups[("pp",)]

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self._groups[("dp",)]

    @property
    def cp_group(self) -> dist.ProcessGroup:
        return self._groups[("cp",)]

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self._groups[("ep",)]

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self._groups[("tp",)]

    def group(self, *axes: str) -> dist.ProcessGroup:
        """This rank's process group along one axis, or over several: `group("dp", "cp")` holds
        the ranks that differ only in their dp and cp coordinates.

        The order the axes are named in does not matter (group ranks follow the mesh order, as
        `group_ranks` lists them; `group(("dp", "cp"))` works too), and axes of size 1 are
        dropped, so a combination with at most one axis of size > 1 is that axis's group.
        Otherwise the group is created on first use (torch's DeviceMesh flattening), which is
        collective: every rank of the mesh must make its first call for a combination at the
        same point. The gradient groups are created with the mesh.
        """
        live = self._live_axes(axes)
        if len(live) == 1:
            return self._groups[live]
        if live not in self._groups:
            if self.world_size != dist.get_world_size():
                raise ValueError(f"a group over {' x '.join(live)} needs a mesh over every rank of the job "
                                 f"(this mesh has {self.world_size} of {dist.get_world_size()})")
            self._groups[live] = self.device_mesh[live]._flatten("_".join(live)).get_group()
        return self._groups[live]

    def group_ranks(self, *axes: str) -> list[int]:
        """Global ranks of this rank's group along `axes` (one or several), in group-rank order."""
        return [self.ranks[r] for r in self.topology.group_of(self.mesh_rank, self._canonical(axes))]

    # -- gradients -------------------------------------------------------------------------

    def gradient_axes(self, param: torch.Tensor) -> tuple[str, ...]:
        """The axes over which `param` is replicated, so over which its gradient is reduced.

        `DENSE_GRADIENT_AXES` (dp, cp, ep) for ordinary weights, `EXPERT_GRADIENT_AXES` (dp, cp)
        for weights marked `param.expert_parallel = True` (set by expert layers). The names are
        returned whatever their sizes; the group drops the axes of size 1. pp and tp never
        appear: a stage's weights live only on it (weights tied across stages have their own
        groups, `trident.pipeline.ties`), and tensor-parallel layers handle their own replicas.
        """
        return EXPERT_GRADIENT_AXES if getattr(param, "expert_parallel", False) else DENSE_GRADIENT_AXES

    def gradient_group(self, param: torch.Tensor) -> dist.ProcessGroup:
        """`group(*gradient_axes(param))`: with cp = ep = 1, the dp group itself. Not collective
        (both gradient groups are created with the mesh)."""
        return self.group(*self.gradient_axes(param))

    # -- groups over part of an axis -------------------------------------------------------

    def subgroup(self, axis: str, indices: Sequence[int], tag: str = "") -> dist.ProcessGroup | None:
        """This rank's group of the ranks at positions `indices` along `axis` (all other
        coordinates equal to its own), or None when its own position is not among them.

        E.g. `subgroup("pp", [0, 2], tag="tied:embed")`: the first and third stage of this rank's
        pipeline. Group rank k is the rank at `indices[k]`. A distinct `tag` gives a distinct
        group over the same ranks (traffic that must not queue behind another's).

        Collective on first use of (axis, indices, tag), over every rank of the mesh, including
        the ranks that belong to none of the groups: each rank creates every such group, one
        per group along `axis`, in the same order. Later calls return the cached group.
        """
        size = self.topology.size(axis)
        indices = tuple(indices)
        if (not indices or any(isinstance(i, bool) or not isinstance(i, int) for i in indices)
                or list(indices) != sorted(set(indices)) or not 0 <= indices[0] <= indices[-1] < size):
            raise ValueError(f"indices must be increasing positions in [0, {size}) along {axis}, got {list(indices)}")
        key = (axis, indices, tag)
        if key not in self._subgroups:
            if self.world_size != dist.get_world_size():
                raise ValueError(f"subgroup needs a mesh over every rank of the job (this mesh has "
                                 f"{self.world_size} of {dist.get_world_size()})")
            mine = None
            for members in self.topology.axis_groups(axis):
                ranks = [self.ranks[members[i]] for i in indices]
                group = dist.new_group(ranks, group_desc=f"trident_{axis}_{tag or 'subgroup'}")
                if self.global_rank in ranks:
                    mine = group
            self._subgroups[key] = mine
        return self._subgroups[key]

    def host_group(self) -> dist.ProcessGroup:
        """A gloo group over every rank of the mesh, for traffic between tensors in host memory
        (parameter-server shards) when the mesh's own groups are NCCL; the mesh group itself when
        it already is gloo. Collective on first use (every rank of the job calls it)."""
        if "host" not in self._subgroups:
            group = self.mesh_group
            if dist.get_backend(group) != "gloo":
                group = dist.new_group(self.ranks, backend="gloo", group_desc="trident_host")
            self._subgroups["host"] = group
        return self._subgroups["host"]

    # -- printing --------------------------------------------------------------------------

    def describe(self) -> str:
        """The layout as a start-up table: every rank's coordinates and the groups per axis
        (pp, dp and tp always; cp, ep and the combined gradient groups when they matter)."""
        t = self.topology
        shown = _shown_axes(t)
        sizes = " x ".join(f"{a} {t.size(a)}" for a in shown)
        at = ", ".join(f"{a} {getattr(self.coords, a)}" for a in shown)
        lines = [f"{sizes} = {t.world_size} rank(s); this is global rank {self.global_rank} at ({at})",
                 t.table(labels=self.ranks)]
        for axis in shown:
            lines.append(f"{axis} groups: " + self._groups_text(axis))
        dense, expert = (self._live_axes(a) for a in (DENSE_GRADIENT_AXES, EXPERT_GRADIENT_AXES))
        labelled = {"gradient": dense} if dense == expert else {"dense gradient": dense, "expert gradient": expert}
        for label, live in labelled.items():
            if len(live) > 1:
                lines.append(f"{label} groups ({' x '.join(live)}): " + self._groups_text(live))
        return "\n".join(lines)

    def _groups_text(self, axes: str | tuple[str, ...]) -> str:
        return " ".join(str([self.ranks[r] for r in g]) for g in self.topology.axis_groups(axes))

    def _canonical(self, axes: tuple) -> tuple[str, ...]:
        """`axes` validated and in mesh order (`group("dp", "cp")` and `group(("dp", "cp"))` alike)."""
        names = tuple(axes[0]) if len(axes) == 1 and not isinstance(axes[0], str) else tuple(axes)
        self.topology.size(names)  # validates: known, distinct, at least one
        return tuple(a for a in AXIS_ORDER if a in names)

    def _live_axes(self, axes: tuple) -> tuple[str, ...]:
        """`axes` in mesh order without those of size 1 (the first of them if all are size 1)."""
        names = self._canonical(axes)
        return tuple(a for a in names if self.topology.size(a) > 1) or names[:1]

    def __repr__(self) -> str:
        sizes = ", ".join(f"{a}={self.topology.size(a)}" for a in _shown_axes(self.topology))
        return f"ParallelMesh({sizes}, global_rank={self.global_rank})"


def _shown_axes(topology: Topology) -> list[str]:
    """pp, dp and tp always (the classic table), cp and ep when they are above 1."""
    return [a for a in AXIS_ORDER if a in AXES or topology.size(a) > 1]


def gradient_group(mesh: ParallelMesh, params) -> dist.ProcessGroup:
    """The one group a strategy reduces (or partitions) `params` over: `mesh.gradient_group` of
    each, which must agree. Expert weights replicate over fewer axes than dense ones, so the
    strategies keep them in groups of their own (trident.moe)."""
    axes = {mesh.gradient_axes(p) for p in params}
    if len(axes) > 1:
        raise ValueError(f"parameters replicated over different mesh axes {sorted(axes)} (expert weights, marked "
                         "expert_parallel=True, beside dense ones) were given to one reduction group; pass the "
                         "expert weights and the dense ones in separate groups")
    return mesh.group(*axes.pop()) if axes else mesh.dp_group
