"""The suite's verdict: one row per (trident strategy, peer), its target, and the table, JSON and
plot that show it. Pure bookkeeping, no timing, so tests/unit/test_bench_suite.py can hold it.

A row's ratio is trident's median step time over the peer's (medians over the interleaved
repeats); a row passes when the ratio is at or below its target. The targets are issue 24's:
stage 0 <= 1.00x DDP, ZeRO-1/2 <= 1.05x DDP, ZeRO-3 <= 1.10x DDP, compiled >= 1.2x eager's speed
(a time ratio <= 1 / 1.2), and every trident row at or below its peer (1.00x).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RowSpec:
    """trident system `ours` against system `peer`; passes when time(ours) / time(peer) <= target."""

    strategy: str
    ours: str
    peer_label: str
    peer: str
    target: float
    goal: str = ""

    @property
    def goal_text(self) -> str:
        return self.goal or f"<= {self.target:.2f}"


def summarize(specs: list[RowSpec], samples: dict[str, list[float]], failures: dict[str, str]) -> list[dict]:
    """One dict per spec: medians (ms), ratio, repeats, target, verdict; a system that failed or
    could not run turns its rows into "not available: <reason>"."""
    rows = []
    for spec in specs:
        row = {"strategy": spec.strategy, "peer": spec.peer_label, "trident_ms": None, "peer_ms": None,
               "ratio": None, "repeats": 0, "target": spec.target, "goal": spec.goal_text, "passed": None,
               "note": ""}
        missing = [(name, failures[name]) for name in (spec.ours, spec.peer) if name in failures]
        if not missing and not (samples.get(spec.ours) and samples.get(spec.peer)):
            missing = [(name, "no sample") for name in (spec.ours, spec.peer) if not samples.get(name)]
        if missing:
            row["note"] = "not available: " + "; ".join(f"{name}: {why}" for name, why in missing)
        else:
            ours, peer = statistics.median(samples[spec.ours]), statistics.median(samples[spec.peer])
            row |= {"trident_ms": 1e3 * ours, "peer_ms": 1e3 * peer, "ratio": ours / peer,
                    "repeats": min(len(samples[spec.ours]), len(samples[spec.peer])),
                    "passed": ours / peer <= spec.target}
        rows.append(row)
    return rows


def _cell(value: float | None, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def verdict(row: dict) -> str:
    if row["passed"] is None:
        return row["note"]
    return "pass" if row["passed"] else "FAIL"


def markdown(rows: list[dict], heading: str) -> str:
    """The table, under a heading paragraph that says how it was measured."""
    lines = [heading, "",
             "| strategy | peer | trident ms | peer ms | trident / peer | repeats | target | result |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['strategy']} | {r['peer']} | {_cell(r['trident_ms'], '.1f')} | "
                     f"{_cell(r['peer_ms'], '.1f')} | {_cell(r['ratio'], '.3f')} | {r['repeats']} | "
                     f"{r['goal']} | {verdict(r)} |")
    measured = [r for r in rows if r["passed"] is not None]
    lines += ["", f"{sum(r['passed'] for r in measured)} of {len(measured)} measured rows meet their target; "
                  f"{len(rows) - len(measured)} not available."]
    return "\n".join(lines) + "\n"


def write_json(path: Path, rows: list[dict], meta: dict, samples: dict[str, list[float]],
               failures: dict[str, str]) -> None:
    """Everything the table says, plus every repeat's step time (ms) per system."""
    data = {"meta": meta, "rows": rows, "failures": failures,
            "samples_ms": {k: [round(1e3 * v, 3) for v in vs] for k, vs in samples.items()}}
    path.write_text(json.dumps(data, indent=2) + "\n")


def plot(rows: list[dict], path: Path, title: str) -> None:
    """One bar per row: trident's step time over its peer's; the peer at 1.0; ticks at the targets."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['strategy']}\nvs {r['peer']}" for r in rows]
    ratios = [r["ratio"] or 0.0 for r in rows]
    colors = ["tab:grey" if r["passed"] is None else "tab:green" if r["passed"] else "tab:red" for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(rows) + 1.6))
    y = range(len(rows))
    ax.barh(y, ratios, color=colors)
    ax.scatter([r["target"] for r in rows], y, marker="D", s=18, color="black", label="target", zorder=3)
    ax.axvline(1.0, color="black", linestyle="--", linewidth=1, label="peer = 1.0")
    for i, r in enumerate(rows):
        text = "not available" if r["ratio"] is None else f"{r['ratio']:.3f}"
        ax.text(max(ratios[i], 0.02) + 0.01, i, text, va="center", fontsize=8)
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max([1.3, *ratios]) * 1.12)
    ax.set_xlabel("step time, trident / peer (lower is faster)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
