"""Shard arithmetic for ZeRO: which elements of which parameter each data-parallel rank owns.

Parameters are grouped into *units*. A unit's parameters are laid end to end in one flat
buffer, padded with zeros to a multiple of the dp size N, and the flat buffer is cut into N
equal *shards*: rank r owns shard r of every unit. Because each unit splits evenly, one
reduce-scatter of a unit's flat gradient leaves every rank exactly its shard, and one
all-gather of the shards rebuilds the unit, with no packing copies.

- Stages 1 and 2 make units of consecutive parameters up to `reduce_bucket_size` elements (a
  unit is a gradient bucket), in reverse registration order, the order backward produces them.
- Stage 3 makes one unit per module (the parameters a module owns directly), so a module's
  weights are gathered with one all-gather just before it runs.

A rank's *partition* is the concatenation of its shards of all units, in unit order: one
contiguous buffer for its gradients, one for its (master) parameters. Nothing here touches
torch.distributed: the layout is pure arithmetic, shared by the runtime, checkpoints and the
offline consolidation tool.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def padded_size(numel: int, world: int) -> int:
    """`numel` rounded up to a multiple of `world`."""
    return -(-numel // world) * world


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter sits: its index in the layout's parameter list, its shape, and its
    element range [offset, offset + numel) in its unit's flat buffer."""

    index: int
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class Unit:
    """Parameters that are gathered and reduced together as one flat, N-padded buffer."""

    index: int
    slots: list[ParamSlot]
    numel: int                 # real elements (sum of the parameters)
    padded: int                # numel rounded up to a multiple of the dp size
    shard: int                 # padded / dp size: elements per rank
    partition_offset: int = 0  # where this unit's shard starts in a rank's partition

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of rank `rank`'s shard in the unit's flat buffer."""
        return rank * self.shard, (rank + 1) * self.shard

    def pieces(self, rank: int) -> list[tuple[ParamSlot, int, int]]:
        """(slot, start, end) of each parameter's elements inside rank `rank`'s shard, in
        element indices of the flattened parameter. Padding is not listed."""
        lo, hi = self.shard_range(rank)
        out = []
        for s in self.slots:
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                out.append((s, a - s.offset, b - s.offset))
        return out


@dataclass
class ShardedLayout:
    """Units of a parameter list split over `world` ranks, and each rank's partition."""

    world: int
    units: list[Unit] = field(default_factory=list)

    @property
    def partition_numel(self) -> int:
        """Elements of one rank's partition (the same on every rank)."""
        return sum(u.shard for u in self.units)

    @property
    def numel(self) -> int:
        return sum(u.numel for u in self.units)

    def unit_of(self) -> dict[int, Unit]:
        """Parameter index -> its unit."""
        return {s.index: u for u in self.units for s in u.slots}

    def describe(self) -> dict:
        """JSON-ready form, written into checkpoint manifests and read back by `from_dict`."""
        return {"world": self.world, "units": [
            {"slots": [[s.index, list(s.shape), s.offset] for s in u.slots], "numel": u.numel}
            for u in self.units]}

    @classmethod
    def from_dict(cls, data: dict) -> ShardedLayout:
        groups = [[ParamSlot(i, tuple(shape), off) for i, shape, off in u["slots"]] for u in data["units"]]
        return _build(groups, data["world"])


def layout_from_groups(groups: list[list[tuple[int, tuple[int, ...]]]], world: int) -> ShardedLayout:
    """A layout whose units are the given lists of (parameter index, shape), in that order."""
    slotted = []
    for group in groups:
        cursor, slots = 0, []
        for index, shape in group:
            slot = ParamSlot(index, tuple(shape), cursor)
            slots.append(slot)
            cursor += slot.numel
        slotted.append(slots)
    return _build(slotted, world)


def bucketed_groups(shapes: list[tuple[int, ...]], bucket_size: int,
                    order: list[int] | None = None) -> list[list[tuple[int, tuple[int, ...]]]]:
    """Consecutive parameters (in `order`, default back to front) cut into groups that close
    once they hold at least `bucket_size` elements; a parameter is never split."""
    if bucket_size < 1:
        raise ValueError(f"bucket size must be >= 1 element, got {bucket_size}")
    order = list(reversed(range(len(shapes)))) if order is None else order
    groups, current, size = [], [], 0
    for i in order:
        current.append((i, tuple(shapes[i])))
        size += ParamSlot(i, tuple(shapes[i]), 0).numel
        if size >= bucket_size:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups


def round_robin_order(count: int, world: int) -> list[int]:
    """Back-to-front parameter order regrouped so that neighbours in backward order land in
    different ranks' hands: every world-th parameter first, then the next residue class."""
    backward = list(reversed(range(count)))
    return [p for r in range(world) for p in backward[r::world]]


def _build(groups: list[list[ParamSlot]], world: int) -> ShardedLayout:
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    layout = ShardedLayout(world=world)
    offset = 0
    for slots in groups:
        numel = sum(s.numel for s in slots)
        padded = padded_size(max(numel, 1), world)
        unit = Unit(index=len(layout.units), slots=slots, numel=numel, padded=padded,
                    shard=padded // world, partition_offset=offset)
        layout.units.append(unit)
        offset += unit.shard
    return layout


def group_units(layout: ShardedLayout, size: int, padded: bool = False) -> list[list]:
    """Consecutive units cut into groups of at most `size` elements (a larger unit alone)."""
    groups, current, total = [], [], 0
    for u in layout.units:
        n = u.padded if padded else u.numel
        if current and total + n > size:
            groups.append(current)
            current, total = [], 0
        current.append(u)
        total += n
    if current:
        groups.append(current)
    return groups
