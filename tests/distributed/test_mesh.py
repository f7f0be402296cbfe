"""ParallelMesh on gloo ranks: coordinates and groups (single axes and combinations) agree with
Topology, reductions over each group sum exactly the ranks Topology names, gradient groups,
subgroups for pipeline ties, solo meshes, and meshes side by side. One 8-rank layout with cp
and ep is marked `eight_ranks`."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from trident.comm import collectives as C
from trident.parallel.mesh import DENSE_GRADIENT_AXES, EXPERT_GRADIENT_AXES, ParallelMesh
from trident.parallel.topology import AXIS_ORDER, Topology
from trident.testing.distributed import cached_mesh, cached_solo_mesh, run_on_ranks

# (pp, dp, cp, ep, tp) on 4 ranks: the classic layouts, then cp and ep
LAYOUTS = [(1, 4, 1, 1, 1), (1, 2, 1, 1, 2), (2, 2, 1, 1, 1), (2, 1, 1, 1, 2), (1, 2, 2, 1, 1), (1, 1, 2, 2, 1)]
COMBINATIONS = [("dp", "cp"), ("cp", "dp"), DENSE_GRADIENT_AXES, ("pp", "tp"), ("dp", "ep", "tp")]


def sizes_of(layout) -> dict[str, int]:
    return dict(zip(AXIS_ORDER, layout))


def group_sum(group: dist.ProcessGroup) -> float:
    """Sum of 2 ** global_rank over `group`: names exactly which ranks took part."""
    x = torch.tensor([2.0 ** dist.get_rank()])
    C.all_reduce(x, group=group)
    return x.item()


def gathered_ranks(group: dist.ProcessGroup) -> list[int]:
    """The global ranks of `group`'s members in group-rank order, as the group itself reports them."""
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, torch.tensor([dist.get_rank()]), group=group)
    return [int(t) for t in out]


def groups_report(mesh: ParallelMesh) -> dict:
    """What every group of `mesh` holds, seen three ways: the mesh's arithmetic, torch's
    membership list, and a reduction and a gather over the real process group."""
    combos = [(a,) for a in AXIS_ORDER] + COMBINATIONS
    return {
        "group_ranks": {c: mesh.group_ranks(*c) for c in combos},
        "torch_ranks": {c: dist.get_process_group_ranks(mesh.group(*c)) for c in combos},
        "gathered": {c: gathered_ranks(mesh.group(*c)) for c in combos},
        "sums": {c: group_sum(mesh.group(*c)) for c in combos},
    }


def describe_layouts(layouts) -> list[dict]:
    out = []
    for layout in layouts:
        mesh = cached_mesh(**sizes_of(layout))
        dense, expert = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
        expert.expert_parallel = True
        out.append({
            "sizes": tuple(getattr(mesh, f"{a}_size") for a in AXIS_ORDER) + (mesh.world_size,),
            "ranks": (mesh.global_rank, mesh.mesh_rank),
            "coords": tuple(getattr(mesh, f"{a}_rank") for a in AXIS_ORDER),
            "same_groups": all(getattr(mesh, f"{a}_group") is mesh.group(a) for a in AXIS_ORDER),
            "combined_is_canonical": mesh.group("cp", "dp") is mesh.group("dp", "cp") is mesh.group(("dp", "cp")),
            "gradient_axes": (mesh.gradient_axes(dense), mesh.gradient_axes(expert)),
            "gradient_groups": (mesh.gradient_group(dense) is mesh.group(*DENSE_GRADIENT_AXES),
                                mesh.gradient_group(expert) is mesh.group(*EXPERT_GRADIENT_AXES),
                                mesh.gradient_group(dense) is mesh.dp_group),
            **groups_report(mesh),
            "describe": mesh.describe(),
            "cached": cached_mesh(pp=layout[0], cp=layout[2], ep=layout[3], tp=layout[4]) is mesh,  # dp derived
        })
    return out


def check_layout(layout, per_rank: list[dict], world: int) -> None:
    topo = Topology(**sizes_of(layout))
    for rank, got in enumerate(per_rank):
        assert got["sizes"] == tuple(layout) + (world,)
        assert got["ranks"] == (rank, rank)
        c = topo.coords(rank)
        assert got["coords"] == tuple(getattr(c, a) for a in AXIS_ORDER)
        assert got["same_groups"] and got["combined_is_canonical"] and got["cached"]
        assert got["gradient_axes"] == (("dp", "cp", "ep"), ("dp", "cp"))
        plain_dp = topo.cp == topo.ep == 1
        assert got["gradient_groups"] == (True, True, plain_dp)  # the dp group itself when cp = ep = 1
        for combo, members in got["group_ranks"].items():
            canonical = tuple(a for a in AXIS_ORDER if a in combo)
            expected = topo.group_of(rank, canonical)  # group-rank order is mesh order
            assert sorted(expected) == sorted(topo.group_of(rank, combo))
            assert members == expected, combo
            assert got["torch_ranks"][combo] == expected, combo
            assert got["gathered"][combo] == expected, combo
            assert got["sums"][combo] == sum(2.0 ** r for r in expected), combo
        shown = [a for a in AXIS_ORDER if a in ("pp", "dp", "tp") or topo.size(a) > 1]
        head = " x ".join(f"{a} {topo.size(a)}" for a in shown)
        assert f"{head} = {world} rank(s); this is global rank {rank}" in got["describe"]
        for axis in shown:
            assert f"{axis} groups: " + " ".join(str(g) for g in topo.axis_groups(axis)) in got["describe"]
        assert ("gradient groups" in got["describe"]) == (sum(topo.size(a) > 1 for a in DENSE_GRADIENT_AXES) > 1)


@pytest.fixture(scope="module")
def layouts():
    return run_on_ranks(4, describe_layouts, LAYOUTS)


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=["x".join(map(str, layout)) for layout in LAYOUTS])
def test_mesh_matches_topology(layouts, index):
    check_layout(LAYOUTS[index], [per_rank[index] for per_rank in layouts], 4)


def test_classic_describe_is_unchanged(layouts):
    """A pp/dp/tp layout prints as before cp and ep existed: no cp, ep or gradient lines."""
    text = layouts[3][2]["describe"]  # rank 3 of pp 2 x dp 2
    assert text.splitlines()[0] == "pp 2 x dp 2 x tp 1 = 4 rank(s); this is global rank 3 at (pp 1, dp 1, tp 0)"
    assert text.splitlines()[1].split() == ["rank", "pp", "dp", "tp"]
    assert [line.split(":")[0] for line in text.splitlines()[6:]] == ["pp groups", "dp groups", "tp groups"]


@pytest.mark.eight_ranks
def test_eight_ranks_with_cp_and_ep():
    """pp 2 x dp 2 x cp 2 and dp 2 x ep 2 x tp 2: every group checked from the real process groups."""
    eight = [(2, 2, 2, 1, 1), (1, 2, 1, 2, 2)]
    results = run_on_ranks(8, describe_layouts, eight, timeout=300)
    for index, layout in enumerate(eight):
        check_layout(layout, [per_rank[index] for per_rank in results], 8)
    print(results[5][0]["describe"])
    dense = results[5][1]["describe"].splitlines()  # dp 2 x ep 2 x tp 2, rank 5
    assert "dense gradient groups (dp x ep): [0, 2, 4, 6] [1, 3, 5, 7]" in dense
    assert "ep groups: [0, 2] [1, 3] [4, 6] [5, 7]" in dense


def subgroups() -> dict:
    mesh = cached_mesh(pp=4)
    first_last = mesh.subgroup("pp", [0, 3], tag="tied:embed")
    middle = mesh.subgroup("pp", [1, 2], tag="tied:block")
    whole = mesh.subgroup("pp", range(4), tag="pp-grads")
    errors = []
    for bad in ([], [2, 1], [0, 4], [1, 1]):
        try:
            mesh.subgroup("pp", bad)
        except ValueError as e:
            errors.append(str(e))
    return {
        "first_last": None if first_last is None else (gathered_ranks(first_last), group_sum(first_last)),
        "middle": None if middle is None else gathered_ranks(middle),
        "whole": (gathered_ranks(whole), whole is not mesh.pp_group),
        "cached": mesh.subgroup("pp", [0, 3], tag="tied:embed") is first_last,
        "errors": errors,
    }


def test_subgroups_over_part_of_an_axis():
    results = run_on_ranks(4, subgroups)
    for rank, got in enumerate(results):
        assert got["first_last"] == (([0, 3], 9.0) if rank in (0, 3) else None)
        assert got["middle"] == ([1, 2] if rank in (1, 2) else None)
        assert got["whole"] == ([0, 1, 2, 3], True)  # same ranks as the pp group, a group of its own
        assert got["cached"]
        assert got["errors"] == [f"indices must be increasing positions in [0, 4) along pp, got {bad}"
                                 for bad in ([], [2, 1], [0, 4], [1, 1])]


def solo_and_coexisting() -> dict:
    solo = ParallelMesh.solo()
    dp_mesh = ParallelMesh.build()  # a second (1, 4, 1) mesh next to the cached one
    tp_mesh = ParallelMesh.build(tp=2)
    solo_sum = {a: group_sum(solo.group(a)) for a in AXIS_ORDER}
    # interleave reductions on both meshes: each must keep to its own groups
    both = (group_sum(dp_mesh.dp_group), group_sum(tp_mesh.tp_group), group_sum(tp_mesh.dp_group),
            group_sum(dp_mesh.dp_group))
    return {
        "solo": (solo.world_size, solo.global_rank, solo.mesh_rank, tuple(solo.coords), solo.ranks,
                 {a: solo.group_ranks(a) for a in AXIS_ORDER}, solo.group_ranks("dp", "cp", "ep")),
        "solo_sum": solo_sum,
        "solo_gradient": solo.gradient_group(torch.zeros(1)) is solo.dp_group,
        "both": both,
        "cached_solo": cached_solo_mesh() is cached_solo_mesh(),
        "cached_solo_rank": cached_solo_mesh().group_ranks("dp"),
    }


def test_solo_meshes_and_two_meshes_side_by_side():
    results = run_on_ranks(4, solo_and_coexisting)
    for rank, got in enumerate(results):
        assert got["solo"] == (1, rank, 0, (0,) * 5, [rank], {a: [rank] for a in AXIS_ORDER}, [rank])
        assert got["solo_sum"] == {a: 2.0 ** rank for a in AXIS_ORDER}
        assert got["solo_gradient"]
        tp_pair = sum(2.0 ** r for r in Topology(1, 2, 2).group_of(rank, "tp"))
        dp_pair = sum(2.0 ** r for r in Topology(1, 2, 2).group_of(rank, "dp"))
        assert got["both"] == (15.0, tp_pair, dp_pair, 15.0)
        assert got["cached_solo"] and got["cached_solo_rank"] == [rank]


def build_errors() -> list[str]:
    messages = []
    for kwargs in ({"pp": 3}, {"pp": 2, "dp": 3}, {"cp": 3}, {"dp": 2, "ep": 3}):
        try:
            ParallelMesh.build(**kwargs)
        except ValueError as e:
            messages.append(str(e))
    mesh = cached_mesh()
    for axes in (("xp",), ("dp", "dp"), ()):
        try:
            mesh.group(*axes)
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_build_and_group_errors_name_the_values():
    messages = run_on_ranks(4, build_errors)[0]
    assert "pp * tp = 3 * 1 = 3 does not divide world_size = 4" in messages[0]
    assert "pp * dp * tp = 2 * 3 * 1 = 6, but the world has 4 ranks" in messages[1]
    assert "pp * cp * tp = 1 * 3 * 1 = 3 does not divide world_size = 4" in messages[2]
    assert "pp * dp * ep * tp = 1 * 2 * 3 * 1 = 6, but the world has 4 ranks" in messages[3]
    assert "axis must be one of 'pp', 'dp', 'cp', 'ep', 'tp', got 'xp'" in messages[4]
    assert "axes must be distinct, got ('dp', 'dp')" in messages[5]
    assert "name at least one axis" in messages[6]
