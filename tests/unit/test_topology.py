"""Topology: rank <-> coordinates on the named axes (pp, dp, cp, ep, tp), checked exhaustively on
small layouts; single-axis and combined-axis groups."""

from __future__ import annotations

import itertools
import math

import pytest

from trident.parallel.topology import AXES, AXIS_ORDER, Coord, Topology

LAYOUTS = [(pp, dp, tp) for pp, dp, tp in itertools.product([1, 2, 3], [1, 2, 3], [1, 2, 4])]


@pytest.mark.parametrize("pp,dp,tp", LAYOUTS)
def test_round_trips_and_tp_innermost(pp, dp, tp):
    topo = Topology(pp=pp, dp=dp, tp=tp)
    assert topo.world_size == pp * dp * tp
    seen = set()
    for rank in range(topo.world_size):
        c = topo.coords(rank)
        assert isinstance(c, Coord)
        assert topo.rank_of(pp=c.pp, dp=c.dp, tp=c.tp) == rank
        assert rank == (c.pp * dp + c.dp) * tp + c.tp  # row-major, tp innermost
        seen.add(c)
    assert seen == set(Coord(*x) for x in itertools.product(range(pp), range(dp), range(tp)))


@pytest.mark.parametrize("pp,dp,tp", LAYOUTS)
def test_axis_groups_partition_the_ranks_along_one_axis(pp, dp, tp):
    topo = Topology(pp=pp, dp=dp, tp=tp)
    for axis in AXES:
        groups = topo.axis_groups(axis)
        assert len(groups) == topo.world_size // topo.size(axis)
        assert sorted(r for g in groups for r in g) == list(range(topo.world_size))
        others = [a for a in AXES if a != axis]
        for group in groups:
            coords = [topo.coords(r) for r in group]
            assert [getattr(c, axis) for c in coords] == list(range(topo.size(axis)))  # in axis order
            for other in others:
                assert len({getattr(c, other) for c in coords}) == 1
            for rank in group:
                assert topo.group_of(rank, axis) == group


def test_known_layout():
    topo = Topology(pp=2, dp=2, tp=2)
    assert topo.axis_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.axis_groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.axis_groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.coords(5) == Coord(pp=1, dp=0, tp=1)
    assert topo.group_of(5, "dp") == [5, 7]
    lines = topo.table().splitlines()
    assert lines[0].split() == ["rank", "pp", "dp", "tp"]
    assert lines[6].split() == ["5", "1", "0", "1"]
    assert len(lines) == 9 and len({len(line) for line in lines}) == 1  # aligned
    labelled = Topology(pp=1, dp=1, tp=1).table(labels=[1234567])
    assert labelled.splitlines()[1].split() == ["1234567", "0", "0", "0"]
    wide = Topology(pp=1, dp=128, tp=1).table().splitlines()
    assert wide[-1].split() == ["127", "0", "127", "0"] and len({len(line) for line in wide}) == 1


def test_for_world_derives_dp():
    assert Topology.for_world(8, pp=2) == Topology(pp=2, dp=4, tp=1)
    assert Topology.for_world(12, pp=3, tp=2) == Topology(pp=3, dp=2, tp=2)
    assert Topology.for_world(1) == Topology(1, 1, 1)


def test_errors_name_the_values():
    with pytest.raises(ValueError, match=r"pp \* tp = 2 \* 3 = 6 does not divide world_size = 8"):
        Topology.for_world(8, pp=2, tp=3)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=rf"dp must be a positive integer .* got {bad!r}"):
            Topology(pp=1, dp=bad, tp=1)
    topo = Topology(pp=1, dp=2, tp=2)
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 4\) .* got 4"):
        topo.coords(4)
    with pytest.raises(ValueError, match=r"tp coordinate must be an integer in \[0, 2\), got 2"):
        topo.rank_of(pp=0, dp=0, tp=2)
    with pytest.raises(ValueError, match=r"axis must be one of 'pp', 'dp', 'tp', got 'ep'"):
        topo.axis_groups("ep")


def test_topology_imports_no_torch_distributed():
    import ast
    import inspect

    import trident.parallel.topology as module

    tree = ast.parse(inspect.getsource(module))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any(name and name.startswith("torch") for name in imported)


# -- named axes beyond pp, dp, tp --------------------------------------------------------------

FIVE = [dict(zip(AXIS_ORDER, sizes)) for sizes in [(2, 1, 2, 1, 1), (1, 2, 1, 2, 1), (1, 2, 2, 1, 2),
                                                    (2, 1, 1, 2, 3), (1, 1, 1, 1, 1), (3, 2, 2, 2, 2)]]


@pytest.mark.parametrize("sizes", FIVE, ids=lambda s: "x".join(map(str, s.values())))
def test_five_named_axes_round_trip_row_major_in_axis_order(sizes):
    topo = Topology(**sizes)
    assert topo.axes == AXIS_ORDER and topo.world_size == math.prod(sizes.values())
    coords = [topo.coords(rank) for rank in range(topo.world_size)]
    # rank order is AXIS_ORDER row-major, tp innermost: enumerating coordinates in that order counts ranks
    order = list(itertools.product(*(range(sizes[a]) for a in AXIS_ORDER)))
    assert [tuple(getattr(c, a) for a in AXIS_ORDER) for c in coords] == order
    for rank, c in enumerate(coords):
        assert topo.rank_of(**c._asdict()) == rank
    for axes in [(a,) for a in AXIS_ORDER] + [("dp", "cp"), ("cp", "dp"), ("dp", "cp", "ep"), ("pp", "tp")]:
        groups = topo.axis_groups(axes)
        assert sorted(r for g in groups for r in g) == list(range(topo.world_size))
        assert groups == sorted(groups) and len(groups) == topo.world_size // topo.size(axes)
        for group in groups:
            members = [topo.coords(r) for r in group]
            fixed = [a for a in AXIS_ORDER if a not in axes]
            assert len({tuple(getattr(c, a) for a in fixed) for c in members}) == 1  # only `axes` vary
            # listed with the first-named axis outermost
            assert [tuple(getattr(c, a) for a in axes) for c in members] == sorted(
                tuple(getattr(c, a) for a in axes) for c in members)
            for rank in group:
                assert topo.group_of(rank, axes) == group


def test_known_five_axis_layout_with_pp_and_cp():
    """pp=2, cp=2, the other three named with size 1: the strides are pp 2, cp 1."""
    topo = Topology(pp=2, dp=1, cp=2, ep=1, tp=1)
    assert [tuple(topo.coords(r)) for r in range(4)] == [(0, 0, 0, 0, 0), (0, 0, 0, 1, 0),
                                                         (1, 0, 0, 0, 0), (1, 0, 0, 1, 0)]
    assert topo.coords(3) == Coord(pp=1, dp=0, tp=0, cp=1, ep=0)
    assert topo.axis_groups("cp") == [[0, 1], [2, 3]]
    assert topo.axis_groups("pp") == [[0, 2], [1, 3]]
    assert topo.axis_groups("ep") == topo.axis_groups("dp") == topo.axis_groups("tp") == [[0], [1], [2], [3]]
    assert topo.axis_groups(("dp", "cp")) == [[0, 1], [2, 3]]  # dp is size 1: the cp groups
    assert topo.rank_of(pp=1, cp=1) == 3
    lines = topo.table().splitlines()
    assert lines[0].split() == ["rank", "pp", "dp", "cp", "tp"]  # ep is 1: no column
    assert lines[4].split() == ["3", "1", "0", "1", "0"]
    assert repr(topo) == "Topology(pp=2, dp=1, cp=2, ep=1, tp=1)"


def test_known_layout_of_the_module_docstring():
    topo = Topology(pp=2, dp=2, cp=2, ep=1, tp=2)
    assert topo.coords(13) == Coord(pp=1, dp=1, tp=1, cp=0, ep=0)
    assert topo.group_of(13, "dp") == [9, 13] and topo.group_of(13, "cp") == [13, 15]
    assert topo.group_of(13, ("dp", "cp")) == [9, 11, 13, 15]
    assert topo.group_of(13, ("cp", "dp")) == [9, 13, 11, 15]  # same ranks, cp outermost
    assert topo.axis_groups(("dp", "cp")) == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert topo.size(("dp", "cp")) == 4


def test_dp_and_ep_named_alone():
    topo = Topology(dp=2, ep=2)
    assert topo.axes == ("dp", "ep") and topo.world_size == 4
    assert topo.axis_groups("ep") == [[0, 1], [2, 3]] and topo.axis_groups("dp") == [[0, 2], [1, 3]]
    assert topo.axis_groups(("dp", "ep")) == [[0, 1, 2, 3]]
    assert (topo.pp, topo.cp, topo.tp) == (1, 1, 1)
    with pytest.raises(ValueError, match=r"axis must be one of 'dp', 'ep', got 'tp'; this layout does not name"):
        topo.size("tp")


def test_for_world_with_cp_and_ep():
    assert Topology.for_world(8, pp=2, cp=2) == Topology(pp=2, dp=2, cp=2, tp=1)
    assert Topology.for_world(8, ep=2, tp=2) == Topology(pp=1, dp=2, ep=2, tp=2)
    assert Topology.for_world(4, cp=1) != Topology.for_world(4)  # cp named or not
    with pytest.raises(ValueError, match=r"pp \* cp \* tp = 1 \* 3 \* 1 = 3 does not divide world_size = 8, .* "
                                         r"choose pp, cp and tp whose product divides 8"):
        Topology.for_world(8, cp=3, ep=1)


def test_combined_axis_errors():
    topo = Topology(pp=2, dp=2, cp=2)
    with pytest.raises(ValueError, match=r"axes must be distinct, got \('dp', 'dp'\)"):
        topo.axis_groups(("dp", "dp"))
    with pytest.raises(ValueError, match="name at least one axis"):
        topo.group_of(0, ())
    with pytest.raises(ValueError, match=r"axis must be one of 'pp', 'dp', 'cp', got 'xp'$"):
        topo.axis_groups(("dp", "xp"))
    with pytest.raises(ValueError, match=r"cp coordinate must be an integer in \[0, 2\), got 2"):
        topo.rank_of(cp=2)
    with pytest.raises(ValueError, match=r"ep coordinate must be an integer in \[0, 1\), got 1"):
        topo.rank_of(ep=1)
