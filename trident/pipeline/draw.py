"""Draw a simulated (or measured) timeline: one row per stage, as text or as a PNG.

Text rows show every compute instruction as its label (F forward, B backward, b input-gradient
pass, W weight-gradient pass, then the micro-batch, then ".chunk" for chunks after the first)
padded over its duration, and idle time as dots:

    stage 0  F0 F1 F2 F3 ...... B0    B1    B2    B3
    stage 1  ...F0 F1 F2 F3 B0    B1    B2    B3 ...
"""

from __future__ import annotations

from pathlib import Path

from trident.pipeline.instructions import COMPUTE, Backward, BackwardInput, BackwardWeight, Forward
from trident.pipeline.simulate import Timeline

_COLORS = {Forward: "#4c78a8", Backward: "#f58518", BackwardInput: "#e45756", BackwardWeight: "#72b7b2"}
LEGEND = "F forward, B backward, b input-gradient pass, W weight-gradient pass, .c chunk c, '.' idle"


def _compute_spans(timeline: Timeline, stage: int) -> list:
    return [sp for sp in timeline.spans[stage] if isinstance(sp.instr, COMPUTE) and sp.end > sp.start]


def text_timeline(timeline: Timeline) -> str:
    """The timeline as text, one row per stage, followed by each stage's idle share."""
    spans = [_compute_spans(timeline, s) for s in range(timeline.stages)]
    flat = [sp for row in spans for sp in row]
    if not flat:
        return "(empty timeline)"
    quantum = min(sp.end - sp.start for sp in flat)
    cell = max(len(str(sp.instr)) for sp in flat) + 1
    width = round(timeline.makespan / quantum * cell)
    lines = []
    for s, row in enumerate(spans):
        chars = ["."] * width
        for sp in row:
            a, b = round(sp.start / quantum * cell), round(sp.end / quantum * cell)
            text = str(sp.instr).ljust(b - a)[: b - a]
            chars[a:b] = list(text)
        lines.append(f"stage {s:<2} {''.join(chars)}")
    lines.append(LEGEND)
    lines += [f"stage {s}: idle {100 * timeline.bubble_fraction(s):.1f}% of the makespan, up to "
              f"{timeline.peak_live[s] if timeline.peak_live else '?'} live micro-batch activations"
              for s in range(timeline.stages)]
    return "\n".join(lines)


def save_png(timeline: Timeline, path: str | Path, title: str = "") -> Path:
    """Write the timeline as a Gantt chart (one bar per compute instruction) to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = timeline.stages
    fig, ax = plt.subplots(figsize=(max(6.0, min(24.0, 0.35 * timeline.makespan + 2)), 0.6 * stages + 1.2))
    for s in range(stages):
        for sp in _compute_spans(timeline, s):
            color = _COLORS[type(sp.instr)]
            ax.broken_barh([(sp.start, sp.end - sp.start)], (s - 0.4, 0.8), facecolors=color, edgecolors="white")
            ax.text((sp.start + sp.end) / 2, s, str(sp.instr), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
    ax.invert_yaxis()
    ax.set_xlim(0, timeline.makespan)
    ax.set_xlabel("time")
    ax.set_title(title or f"bubble {100 * timeline.bubble_fraction():.1f}%")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
