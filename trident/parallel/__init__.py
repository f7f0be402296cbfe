"""The parallel layout: pure rank arithmetic (topology) and the process groups built from it (mesh)."""

from trident.parallel.mesh import DENSE_GRADIENT_AXES, EXPERT_GRADIENT_AXES, ParallelMesh
from trident.parallel.topology import AXES, AXIS_ORDER, Coord, Topology

__all__ = ["AXES", "AXIS_ORDER", "Coord", "DENSE_GRADIENT_AXES", "EXPERT_GRADIENT_AXES", "ParallelMesh", "Topology"]
