"""Hostfiles and resource filters, read as DeepSpeed's launcher reads them.

A hostfile lists one host a line, `NAME slots=N` (N ranks, one per GPU), in the order that
gives the node ranks; blank lines and lines starting with `#` are skipped, and so is the rest
of a line after ` #`. MPI-style `key=value` fields after `slots=N` (`max_slots=8`) are
ignored, as DeepSpeed's pattern ignores them. A host listed twice, a line that is not
`NAME slots=N`, `slots=0` and a file with no hosts are errors naming the file and line.

`--include` / `--exclude` take `NODE_SPEC[@NODE_SPEC ...]` with `NODE_SPEC = NAME[:SLOT[,SLOT ...]]`
(`worker-0@worker-1:0,2`: every slot of worker-0, slots 0 and 2 of worker-1). They are
mutually exclusive. `--include` keeps only the hosts it names (all their slots, or the ones
listed); `--exclude` drops the slots it names, or the whole host when no slot is given; a host
left without slots is dropped. The hosts keep the hostfile's order either way. `--num_nodes N`
keeps the first N hosts, `--num_gpus G` the first G slots of every host; neither goes with
`--include` / `--exclude`. Unlike DeepSpeed, an included slot a host does not have is an error
(DeepSpeed checks only excluded slots), and so is a `--num_gpus` above a host's slots.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LINE = re.compile(r"^(?P<name>\S+)\s+slots=(?P<slots>\d+)(?P<rest>.*)$")
_EXTRA = re.compile(r"^\w+=\S*$")


class HostfileError(ValueError):
    """A hostfile or a resource filter that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class Host:
    """One hostfile line: the host's name, its slot count, and where it was read."""

    name: str
    slots: int
    source: str
    line: int

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"


def parse_hostfile(text: str, source: str = "<hostfile>") -> dict[str, Host]:
    """The hosts of a hostfile's text, in file order (see module doc for the format)."""
    hosts: dict[str, Host] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        line = re.split(r"\s#", line, maxsplit=1)[0].rstrip()
        match = _LINE.match(line)
        extra = match.group("rest").split() if match else []
        if match is None or any(not _EXTRA.match(field) for field in extra):
            raise HostfileError(f"{source}:{number}: expected `HOSTNAME slots=N` (e.g. `worker-0 slots=8`), "
                                f"got {raw.strip()!r}")
        name, slots = match.group("name"), int(match.group("slots"))
        if name in hosts:
            raise HostfileError(f"{source}:{number}: host {name!r} is listed twice (first at line "
                                f"{hosts[name].line}); give each host one line with its total slots")
        if slots < 1:
            raise HostfileError(f"{source}:{number}: host {name!r} has slots={slots}; a host needs at least "
                                "one slot (leave it out, or --exclude it)")
        hosts[name] = Host(name, slots, source, number)
    if not hosts:
        raise HostfileError(f"{source}: no hosts in it; expected lines like `worker-0 slots=8`")
    return hosts


def read_hostfile(path: str) -> dict[str, Host]:
    """The hosts of the hostfile at `path` (an error naming the path when it cannot be read)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise HostfileError(f"hostfile {path}: cannot read it ({err.strerror or err})") from None
    return parse_hostfile(text, source=path)


def parse_node_spec(spec: str, flag: str = "--include") -> dict[str, list[int]]:
    """`host1:0,1@host2` -> {host1: [0, 1], host2: []} (an empty list: the whole host). A host
    named twice gets the union of the slots listed for it, sorted (as DeepSpeed merges them)."""
    nodes: dict[str, list[int]] = {}
    for part in spec.split("@"):
        name, sep, slot_text = part.partition(":")
        if not name or (sep and not slot_text) or ":" in slot_text:
            raise HostfileError(f"{flag} {spec!r}: {part!r} is not NAME or NAME:SLOT[,SLOT...] "
                                "(hosts are separated by '@', e.g. worker-0@worker-1:0,2)")
        slots = nodes.setdefault(name, [])
        for item in slot_text.split(",") if sep else []:
            if not item.strip().isdigit():
                raise HostfileError(f"{flag} {spec!r}: slot {item!r} of host {name!r} is not a slot index "
                                    "(a whole number, e.g. worker-1:0,2)")
            slots.append(int(item))
    return {name: sorted(set(slots)) for name, slots in nodes.items()}


def _check_names(spec: dict[str, list[int]], hosts: dict[str, Host], flag: str, text: str) -> None:
    source = next(iter(hosts.values())).source
    for name, slots in spec.items():
        if name not in hosts:
            raise HostfileError(f"{flag} {text!r}: host {name!r} is not in the hostfile {source} "
                                f"(its hosts: {', '.join(hosts)})")
        host = hosts[name]
        bad = [s for s in slots if s >= host.slots]
        if bad:
            raise HostfileError(f"{flag} {text!r}: slot {bad[0]} of host {name!r} is out of range: {host.where} "
                                f"gives it slots={host.slots} (slots 0..{host.slots - 1})")


def select_slots(hosts: dict[str, Host], include: str = "", exclude: str = "", num_nodes: int = -1,
                 num_gpus: int = -1) -> dict[str, list[int]]:
    """The slots a job runs on, per host in hostfile order, after the filters (module doc)."""
    if include and exclude:
        raise HostfileError("--include and --exclude are mutually exclusive; give one of them")
    if (include or exclude) and (num_nodes > 0 or num_gpus > 0):
        raise HostfileError("--num_nodes / --num_gpus do not go with --include / --exclude "
                            "(as in DeepSpeed); say which hosts and slots with one or the other")
    active = {name: list(range(host.slots)) for name, host in hosts.items()}
    if include:
        spec = parse_node_spec(include, "--include")
        _check_names(spec, hosts, "--include", include)
        active = {name: (spec[name] or slots) for name, slots in active.items() if name in spec}
    elif exclude:
        spec = parse_node_spec(exclude, "--exclude")
        _check_names(spec, hosts, "--exclude", exclude)
        active = {name: ([s for s in slots if s not in spec[name]] if spec.get(name) else
                         ([] if name in spec else slots)) for name, slots in active.items()}
    active = {name: slots for name, slots in active.items() if slots}
    if num_nodes > 0:
        if num_nodes > len(active):
            raise HostfileError(f"--num_nodes {num_nodes}: the hostfile {next(iter(hosts.values())).source} lists "
                                f"{len(active)} host(s)")
        active = dict(list(active.items())[:num_nodes])
    if num_gpus > 0:
        for name, slots in active.items():
            if num_gpus > len(slots):
                raise HostfileError(f"--num_gpus {num_gpus}: host {name!r} has slots={hosts[name].slots} "
                                    f"({hosts[name].where})")
        active = {name: slots[:num_gpus] for name, slots in active.items()}
    if not active:
        raise HostfileError(f"{include and '--include ' + repr(include) or '--exclude ' + repr(exclude)}: "
                            "no slots are left to run on")
    return active


def format_slots(active: dict[str, list[int]]) -> str:
    """`hostA:0,1@hostB:0`, the --include spec that selects exactly `active`."""
    return "@".join(f"{name}:{','.join(map(str, slots))}" for name, slots in active.items())
