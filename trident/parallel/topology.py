"""Rank <-> coordinates on the named mesh axes: the pure arithmetic of a parallel layout.

The axes, outermost first, are

    pp  pipeline stages          cp  context (sequence) shards     tp  tensor-parallel shards
    dp  data-parallel replicas   ep  expert shards

A layout names any subset of them; an axis it leaves out has size 1. Ranks are laid out
row-major in that order, tp innermost: each axis's *stride* is the product of the sizes of the
axes after it, and

    rank = pp * stride_pp + dp * stride_dp + cp * stride_cp + ep * stride_ep + tp

so neighbouring ranks share a tensor-parallel group. torchrun numbers the ranks of one node
consecutively, which puts each tp group (the most talkative axis) on one node. For the classic
three axes this is `rank = (pp * dp_size + dp) * tp_size + tp`. With all five named, pp=2,
dp=2, cp=2, ep=1, tp=2 (strides 8, 4, 2, 2, 1):

    rank:  0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15
    pp:    0  0  0  0  0  0  0  0  1  1  1  1  1  1  1  1
    dp:    0  0  0  0  1  1  1  1  0  0  0  0  1  1  1  1
    cp:    0  0  1  1  0  0  1  1  0  0  1  1  0  0  1  1
    ep:    0  0  0  0  0  0  0  0  0  0  0  0  0  0  0  0
    tp:    0  1  0  1  0  1  0  1  0  1  0  1  0  1  0  1

Rank 13 is at (pp 1, dp 1, cp 0, ep 0, tp 1): its dp group is [9, 13], its cp group [13, 15].
A *combined* group over several axes holds the ranks that differ only in those coordinates,
listed with the first-named axis outermost: `group_of(13, ("dp", "cp"))` is [9, 11, 13, 15]
and `group_of(13, ("cp", "dp"))` is [9, 13, 11, 15] (same ranks, other order). In the
canonical order (`AXIS_ORDER`) a group's ranks come out ascending.

This module imports no torch.distributed: it is unit-tested without processes, and the mesh
(`trident.parallel.mesh`) builds its process groups from these lists.
"""

from __future__ import annotations

from itertools import product
from math import prod
from typing import NamedTuple, Sequence

AXIS_ORDER = ("pp", "dp", "cp", "ep", "tp")
"""Every mesh axis, outermost first: the order ranks are laid out in."""

AXES = ("pp", "dp", "tp")
"""The classic 3-D layout's axes, which `Topology(pp, dp, tp)` names (and every start-up table shows)."""

Axes = str | Sequence[str]
"""One axis name, or several for a combined group (first-named outermost)."""


class Coord(NamedTuple):
    """A rank's position on each axis (0 on an axis the layout does not name).

    The fields keep the original three first so `Coord(pp, dp, tp)` still reads positionally;
    the rank order is `AXIS_ORDER`, not the field order.
    """

    pp: int
    dp: int
    tp: int
    cp: int = 0
    ep: int = 0


def _check_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer (1, 2, ...), got {value!r}")
    return value


class Topology:
    """The layout of the ranks over the named axes, in `AXIS_ORDER` with tp innermost.

    `Topology(pp, dp, tp)` names the classic three; `Topology(pp=2, cp=2)` names pp and cp.
    Sizes of named axes are given, left-out axes have size 1. Asking about an axis the layout
    does not name is an error, so a misspelt or forgotten axis is loud rather than size 1.
    """

    def __init__(self, pp: int | None = None, dp: int | None = None, tp: int | None = None, *,
                 cp: int | None = None, ep: int | None = None) -> None:
        given = {"pp": pp, "dp": dp, "cp": cp, "ep": ep, "tp": tp}
        self.axes: tuple[str, ...] = tuple(a for a in AXIS_ORDER if given[a] is not None)
        self.sizes: dict[str, int] = {a: 1 if given[a] is None else _check_size(a, given[a]) for a in AXIS_ORDER}
        self._strides = {a: prod(self.sizes[b] for b in AXIS_ORDER[i + 1:]) for i, a in enumerate(AXIS_ORDER)}

    @classmethod
    def for_world(cls, world_size: int, pp: int = 1, tp: int = 1, *, cp: int | None = None,
                  ep: int | None = None) -> Topology:
        """The layout of `world_size` ranks with the given pp, tp (and cp, ep); dp takes the rest."""
        _check_size("world_size", world_size)
        fixed = {"pp": pp, "cp": cp, "ep": ep, "tp": tp}
        fixed = {a: _check_size(a, s) for a, s in fixed.items() if s is not None}
        named = {a: s for a, s in fixed.items() if a in ("pp", "tp") or s > 1}  # what the message shows
        product_ = prod(fixed.values())
        if world_size % product_ != 0:
            names = list(named)
            listed = ", ".join(names[:-1]) + f" and {names[-1]}"
            raise ValueError(
                f"{' * '.join(names)} = {' * '.join(map(str, named.values()))} = {product_} does not divide "
                f"world_size = {world_size}, so no whole number of data-parallel replicas fits; choose "
                f"{listed} whose product divides {world_size}, or launch a multiple of {product_} processes")
        return cls(dp=world_size // product_, **fixed)

    @property
    def pp(self) -> int:
        return self.sizes["pp"]

    @property
    def dp(self) -> int:
        return self.sizes["dp"]

    @property
    def cp(self) -> int:
        return self.sizes["cp"]

    @property
    def ep(self) -> int:
        return self.sizes["ep"]

    @property
    def tp(self) -> int:
        return self.sizes["tp"]

    @property
    def world_size(self) -> int:
        return prod(self.sizes.values())

    def size(self, axes: Axes) -> int:
        """Number of ranks along `axes` (one axis, or the product over several)."""
        return prod(self.sizes[a] for a in self._check_axes(axes))

    def coords(self, rank: int) -> Coord:
        """Where `rank` sits on each axis."""
        self._check_rank(rank)
        return Coord(**{a: rank // self._strides[a] % self.sizes[a] for a in AXIS_ORDER})

    def rank_of(self, *, pp: int = 0, dp: int = 0, cp: int = 0, ep: int = 0, tp: int = 0) -> int:
        """The rank at the given coordinates (an axis left out is at coordinate 0)."""
        given = {"pp": pp, "dp": dp, "cp": cp, "ep": ep, "tp": tp}
        for name in AXIS_ORDER:
            value, size = given[name], self.sizes[name]
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
                raise ValueError(f"{name} coordinate must be an integer in [0, {size}), got {value!r}")
        return sum(given[a] * self._strides[a] for a in AXIS_ORDER)

    def axis_groups(self, axes: Axes) -> list[list[int]]:
        """Every group along `axes`: ranks that differ only in those coordinates, each group
        listed with the first-named axis outermost.

        Groups are listed in increasing order of their first rank; together they cover every
        rank exactly once.
        """
        names = self._check_axes(axes)
        others = [a for a in AXIS_ORDER if a not in names]
        offsets = self._offsets(names)
        bases = (sum(c * self._strides[a] for a, c in zip(others, cs))
                 for cs in product(*(range(self.sizes[a]) for a in others)))
        return sorted([base + o for o in offsets] for base in bases)

    def group_of(self, rank: int, axes: Axes) -> list[int]:
        """The ranks of `rank`'s group along `axes` (including `rank`), first-named axis outermost."""
        names = self._check_axes(axes)
        c = self.coords(rank)
        base = rank - sum(getattr(c, a) * self._strides[a] for a in names)
        return [base + o for o in self._offsets(names)]

    def table(self, labels: Sequence[int] | None = None) -> str:
        """One line per rank: rank -> its coordinates. `labels` replaces the rank column (e.g. global
        ranks). Columns: pp, dp and tp always, cp and ep when their size is above 1."""
        labels = list(range(self.world_size)) if labels is None else list(labels)
        if len(labels) != self.world_size:
            raise ValueError(f"labels must name all {self.world_size} ranks, got {len(labels)}")
        shown = [a for a in AXIS_ORDER if a in AXES or self.sizes[a] > 1]
        width = max(4, *(len(str(label)) for label in labels))
        w = max(2, len(str(max(self.sizes.values()) - 1)))
        lines = [f"{'rank':>{width}}" + "".join(f"  {a:>{w}}" for a in shown)]
        for rank, label in enumerate(labels):
            c = self.coords(rank)
            lines.append(f"{label:>{width}}" + "".join(f"  {getattr(c, a):>{w}}" for a in shown))
        return "\n".join(lines)

    def _offsets(self, names: tuple[str, ...]) -> list[int]:
        """Rank offsets of one group along `names` from its first rank, first name outermost."""
        return [sum(k * self._strides[a] for a, k in zip(names, ks))
                for ks in product(*(range(self.sizes[a]) for a in names))]

    def _check_axes(self, axes: Axes) -> tuple[str, ...]:
        names = (axes,) if isinstance(axes, str) else tuple(axes)
        if not names:
            raise ValueError("name at least one axis")
        for axis in names:
            if axis not in self.axes:
                hint = (f"; this layout does not name {axis!r} (name it, e.g. {axis}=1, to ask about it)"
                        if axis in AXIS_ORDER else "")
                raise ValueError(f"axis must be one of {', '.join(map(repr, self.axes))}, got {axis!r}{hint}")
        if len(set(names)) != len(names):
            raise ValueError(f"axes must be distinct, got {names}")
        return names

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an integer in [0, {self.world_size}) for {self!r}, got {rank!r}")

    def _key(self) -> tuple:
        return self.axes, tuple(self.sizes[a] for a in AXIS_ORDER)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Topology) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return "Topology(" + ", ".join(f"{a}={self.sizes[a]}" for a in self.axes) + ")"
