"""Turn the ranks' flight-recorder snapshots into one message (pure functions, no processes).

A snapshot (FlightRecorder.snapshot plus the watchdog's `now_at`) holds a rank's recent
records, the calls it is waiting on and, per stream, how many calls it has issued. For a stuck
call #s on a stream, a member rank *reached* it when it has issued at least s calls on that
stream; the others are somewhere else, and their last record and current stack say where.
"""

from __future__ import annotations

from typing import Any


def stream_label(key: str) -> str:
    """'group [0, 1]' for a process group's stream (its internal name dropped), else the key."""
    if key.startswith("group "):
        return "group " + key[key.index("["):]
    return key


def call_label(rec: dict, stream: list | None = None) -> str:
    """'all_reduce #7 on group [0, 1]' for the record's first stream (or the one given)."""
    key, _, seq = stream if stream is not None else rec["streams"][0]
    return f"{rec['op']} #{seq} on {stream_label(key)}"


def tensor_label(rec: dict) -> str:
    if rec.get("shape") is None:
        return "no tensor"
    return f"{rec['dtype']}[{', '.join(str(n) for n in rec['shape'])}]"


def _where(state: dict) -> str:
    """Where a rank that did not reach the call is: waiting elsewhere, or its last call."""
    parts = []
    if state.get("waiting"):
        w = state["waiting"][0]
        parts.append(f"it is waiting in {call_label(w)} since {w.get('waited', 0):.1f} s ({w['site']})")
    elif state.get("records"):
        last = state["records"][-1]
        when = f"done {last['done_ago']:.1f} s ago" if "done_ago" in last else last["state"]
        parts.append(f"its last call was {call_label(last)} ({when}, {last['site']})")
    else:
        parts.append("it has issued no recorded call")
    if state.get("now_at"):
        parts.append(f"it is now at {state['now_at']}")
    return "; ".join(parts)


def _record_at(state: dict, key: str, seq: int) -> dict | None:
    for rec in state.get("records", ()):
        for k, _, s in rec["streams"]:
            if k == key and s == seq:
                return rec
    return None


def _signature(rec: dict, collective: bool) -> tuple:
    # A send is matched by a recv: for p2p only the tensor has to agree.
    return (rec["op"] if collective else "", tuple(rec["shape"] or ()), rec["dtype"])


def first_divergence(states: dict[int, dict], key: str) -> tuple[int, dict[int, dict]] | None:
    """The lowest sequence number on stream `key` at which the ranks' recorded calls differ
    (op, shape or dtype), with each rank's record there; None if all kept records agree."""
    collective = key.startswith("group ")
    by_seq: dict[int, dict[int, dict]] = {}
    for rank, state in states.items():
        for rec in state.get("records", ()):
            for k, _, seq in rec["streams"]:
                if k == key:
                    by_seq.setdefault(seq, {})[rank] = rec
    for seq in sorted(by_seq):
        recs = by_seq[seq]
        if len({_signature(r, collective) for r in recs.values()}) > 1:
            return seq, recs
    return None


def divergence_line(key: str, seq: int, recs: dict[int, dict]) -> str:
    calls = "; ".join(f"rank {rank}: {rec['op']} {tensor_label(rec)} ({rec['site']})"
                      for rank, rec in sorted(recs.items()))
    return f"call #{seq} on {stream_label(key)} differs between ranks: {calls}"


def hang_report(info: dict, states: dict[int, dict], world: list[int]) -> tuple[str, dict]:
    """The message for a call that waited past the timeout, and a summary for the launcher.

    `info` is the alarm: {"rank", "record", "timeout_s"}; `states` maps each rank that
    answered to its snapshot; `world` lists every rank of the job.
    """
    rec, reporter = info["record"], info["rank"]
    head = (f"trident hang detector: rank {reporter} waited {rec.get('waited', 0):.1f} s "
            f"(distributed.timeout_s = {info['timeout_s']:g}) in {call_label(rec)} "
            f"({tensor_label(rec)}, {rec['site']}).")
    lines, missing, reached, silent = [head], [], [], []
    members = sorted({r for _, ranks, _ in rec["streams"] for r in ranks})
    for rank in members:
        state = states.get(rank)
        if state is None:
            silent.append(rank)
            continue
        counts = state.get("streams", {})
        if all(counts.get(key, {}).get("seq", 0) >= seq for key, ranks, seq in rec["streams"] if rank in ranks):
            reached.append(rank)
        else:
            missing.append(rank)
    lines.append(f"  reached it:       {_ranks(reached)}")
    for rank in missing:
        lines.append(f"  did not reach it: rank {rank}: {_where(states[rank])}")
    if silent:
        lines.append(f"  no report from:   {_ranks(silent)} (the process is gone or did not answer)")
    for rank in sorted(set(world) - set(members)):
        state = states.get(rank)
        if state is not None and state.get("waiting"):
            lines.append(f"  elsewhere:        rank {rank}: {_where(state)}")
    for key, _, _ in rec["streams"]:
        found = first_divergence(states, key)
        if found is not None:
            lines.append("  first divergence: " + divergence_line(key, *found))
    lines.append("The job stops on every rank. If this call legitimately takes longer, raise "
                 "distributed.timeout_s in the config.")
    culprits = missing or silent
    headline = (f"{call_label(rec)} did not complete within {info['timeout_s']:g} s; "
                + (f"not reached by rank(s) {', '.join(map(str, culprits))}" if culprits
                   else "every member reached it (the transport itself is stuck)"))
    return "\n".join(lines), {"kind": "hang", "headline": headline, "culprits": culprits or [reporter]}


def divergence_report(info: dict, states: dict[int, dict]) -> tuple[str, dict]:
    """The message for strict mode's mismatch of running hashes on one stream."""
    key, seq_from, seq_to = info["stream"], info["seq_from"], info["seq_to"]
    found = first_divergence(states, key)
    head = f"trident strict collectives: the ranks of {stream_label(key)} issued different collectives"
    if found is not None and found[0] <= seq_to:
        detail = divergence_line(key, *found)
        culprits = _odd_ones_out(found[1])
    else:
        detail = (f"somewhere in calls #{seq_from + 1}..#{seq_to} on {stream_label(key)} (those records are "
                  f"no longer in the flight recorder; raise distributed.flight_recorder_size to see them)")
        culprits = []
    hashes = ", ".join(f"rank {r}: {h}" for r, h in sorted(info.get("hashes", {}).items(), key=lambda x: int(x[0])))
    text = (f"{head}: {detail}.\n  running hashes at call #{seq_to}: {hashes}\n"
            "The job stops on every rank: every rank of a group must issue the same collectives in "
            "the same order (check rank-dependent branches around the calls named above).")
    return text, {"kind": "divergence", "headline": f"{head}: {detail}", "culprits": culprits}


def _odd_ones_out(recs: dict[int, dict]) -> list[int]:
    """Ranks whose call differs from the most common one (on a tie, from the lowest rank's)."""
    sigs = {rank: _signature(rec, True) for rank, rec in sorted(recs.items())}
    counts: dict[tuple, int] = {}
    for sig in sigs.values():
        counts[sig] = counts.get(sig, 0) + 1
    common = max(counts, key=lambda s: counts[s])  # max keeps the first of equals: the lowest rank's
    return [rank for rank, sig in sigs.items() if sig != common]


def _ranks(ranks: list[int]) -> str:
    if not ranks:
        return "none"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def failure_line(rank: int, info: dict[str, Any]) -> str:
    """What a rank prints when it stops because another rank failed (the traceback is there)."""
    return (f"trident: rank {rank} stops because rank {info['rank']} failed with {info['error']} "
            f"(its traceback is in rank {info['rank']}'s output)")
