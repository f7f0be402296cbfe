"""The layout search: every valid layout for a world size, ranked by predicted throughput.

Layouts are generated only from choices that are valid by construction (tp, pp and dp
multiply to the world size; stages 2-3 only without a pipeline; offload only where ZeRO
allows it), and each is also checked with `layout_problems`, the same rules `estimate`
applies. (dp, tp, pp) splits that break a model rule (tp must divide the heads, pp the
layers) are reported with their reason, as are layouts that do not fit in memory. The ranking
is a total order: tokens/s descending, then device memory ascending, then the layout's text,
so equal predictions always come out in the same order.

Context parallelism (cp) is searched where it can pay: cp divides the world size, 2 x cp
divides the sequence length, and each rank keeps at least `CP_MIN_LOCAL_TOKENS` tokens of a
sequence (below that the ring's blocks are too small to hide their sends, and activations are
rarely what does not fit). Under cp > 1 selective recomputation is skipped: ring and Ulysses
attention keep no scores, so it would save nothing and only recompute.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from trident.planner.estimate import Estimate, estimate
from trident.planner.layout import Layout, Workload, grad_accumulation, layout_problems
from trident.planner.presets import Cluster, GiB, ModelSpec


@dataclass(frozen=True)
class SearchSpace:
    """The choices the search combines for each (dp, tp, pp) split."""

    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    offloads: tuple[tuple[str, str], ...] = (("none", "none"), ("cpu", "none"), ("cpu", "cpu"))
    checkpointing: tuple[str, ...] = ("none", "selective", "full")
    sequence_parallel: tuple[bool, ...] = (False, True)
    micro_batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    schedule: str = "1f1b"
    context_parallel: tuple[int, ...] | None = None  # None: every cp where it can pay (`cp_choices`)


CP_MIN_LOCAL_TOKENS = 4096
"""The fewest tokens of a sequence a cp rank should hold for the search to try that cp."""


def cp_choices(world: int, seq_len: int, space: SearchSpace) -> list[int]:
    """The cp sizes to search: `space.context_parallel` (those dividing the world size), or 1 and
    every divisor of the world size with seq_len divisible by 2 x cp and at least
    `CP_MIN_LOCAL_TOKENS` tokens per rank."""
    if space.context_parallel is not None:
        return [c for c in space.context_parallel if c >= 1 and world % c == 0]
    return [c for c in _divisors(world)
            if c == 1 or (seq_len % (2 * c) == 0 and seq_len // c >= CP_MIN_LOCAL_TOKENS)]


@dataclass(frozen=True)
class Candidate:
    """One searched layout, its prediction, and why it ranks where it does or was rejected."""

    layout: Layout
    estimate: Estimate
    reason: str

    def to_dict(self) -> dict:
        t = self.estimate.time
        return {"layout": self.layout.describe(), "tokens_per_s_per_gpu": t.tokens_per_s_per_gpu, "mfu": t.mfu,
                "step_s": t.step, "device_bytes": self.estimate.memory.device_total, "reason": self.reason}

    def sort_key(self) -> tuple:
        return (-self.estimate.time.tokens_per_s, self.estimate.memory.device_total, self.layout.describe())


@dataclass
class SearchResult:
    """Ranked layouts that fit, layouts that do not fit, and splits that are invalid."""

    ranked: list[Candidate] = field(default_factory=list)
    too_big: list[Candidate] = field(default_factory=list)
    invalid: list[tuple[Layout, list[str]]] = field(default_factory=list)

    def format(self, top: int = 10, rejected: int = 10) -> str:
        closest = sorted(self.too_big, key=lambda c: (c.estimate.memory.device_total, c.layout.describe()))
        # the layout column is as wide as its longest entry plus two spaces, so a long layout
        # (offload=cpu/cpu) never runs into the next column
        shown = self.ranked[:top] + closest[:rejected]
        w = max([52] + [len(c.layout.describe()) + 2 for c in shown])
        lines = [f"{len(self.ranked)} layouts fit, {len(self.too_big)} do not fit in memory, "
                 f"{len(self.invalid)} (dp, cp, tp, pp) splits are invalid for this model", "",
                 f"{'#':>3}  {'layout':<{w}}{'tok/s/GPU':>10}{'MFU':>7}{'step s':>9}{'GiB':>8}  why"]
        for i, c in enumerate(self.ranked[:top], 1):
            t, m = c.estimate.time, c.estimate.memory
            lines.append(f"{i:>3}  {c.layout.describe():<{w}}{t.tokens_per_s_per_gpu:>10.1f}{100 * t.mfu:>6.1f}%"
                         f"{t.step:>9.3f}{m.device_total / GiB:>8.1f}  {c.reason}")
        if self.too_big:
            lines += ["", f"does not fit (the {min(rejected, len(self.too_big))} closest of {len(self.too_big)}):"]
            lines += [f"     {c.layout.describe():<{w}}{c.reason}" for c in closest[:rejected]]
        if self.invalid:
            lines += ["", "invalid splits:"] + [f"     {_split_text(lay)}: {'; '.join(why)}"
                                                for lay, why in self.invalid]
        return "\n".join(lines)

    def to_dict(self, top: int | None = None) -> dict:
        return {"ranked": [c.to_dict() for c in self.ranked[:top]], "too_big": [c.to_dict() for c in self.too_big],
                "invalid": [{"layout": _split_text(lay), "reasons": why}
                            for lay, why in self.invalid]}


def _split_text(layout: Layout) -> str:
    """`dp4 cp2 tp2 pp1`: the split alone (cp only when > 1)."""
    return " ".join(layout.describe().split()[:4 if layout.cp > 1 else 3])


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _why_rank(est: Estimate) -> str:
    """The biggest share of the step that is not useful compute: what holds this layout back."""
    t = est.time
    parts = {"tp comm": t.tp_comm, "pp comm": t.pp_comm, "cp comm": t.cp_comm, "dp comm": t.dp_comm_exposed,
             "bubble": t.bubble,
             "optimizer": t.optimizer}
    name, worst = max(parts.items(), key=lambda kv: (kv[1], kv[0]))
    compute = 100 * t.compute / t.step
    return f"compute {compute:.0f}% of the step; largest overhead {name} {100 * worst / t.step:.0f}%"


def _why_too_big(est: Estimate) -> str:
    m = est.memory
    parts = {"model states": m.placement.device, "activations": m.activations,
             "buffers": m.comm_buffers + m.fragmentation}
    name = max(parts, key=parts.get)
    return (f"needs {m.device_total / GiB:.1f} GiB of {m.capacity / GiB:.1f} GiB per GPU "
            f"({name} {parts[name] / GiB:.1f} GiB)")


def _layouts(dp: int, tp: int, pp: int, workload: Workload, space: SearchSpace, cp: int = 1):
    for stage in space.zero_stages:
        if stage >= 2 and pp > 1:
            continue
        for opt, par in space.offloads:
            if (opt != "none" and stage == 0) or (par != "none" and stage != 3):
                continue
            if opt == "nvme" and workload.optimizer.lower() == "muon":
                continue  # trident.engine.muon refuses Muon states on NVMe
            for ckpt in space.checkpointing:
                if cp > 1 and ckpt == "selective" and len(space.checkpointing) > 1:
                    continue  # no scores to drop under cp: selective is "none" plus recompute
                for sp in space.sequence_parallel:
                    if sp and tp == 1:
                        continue
                    for mb in space.micro_batches:
                        layout = Layout(dp, tp, pp, stage, mb, ckpt, sp, opt, par, space.schedule if pp > 1 else "1f1b",
                                        cp=cp)
                        if grad_accumulation(layout, workload) is not None:
                            yield layout


def search(model: ModelSpec, cluster: Cluster, workload: Workload, space: SearchSpace | None = None) -> SearchResult:
    """Estimate every valid layout of `model` on all of `cluster`'s GPUs and rank those that fit."""
    space = space or SearchSpace()
    result = SearchResult()
    world = cluster.num_gpus
    for cp in cp_choices(world, workload.seq_len, space):
        for tp in _divisors(world // cp):
            for pp in _divisors(world // (cp * tp)):
                dp = world // (cp * tp * pp)
                _search_split(model, cluster, workload, space, result, Layout(dp, tp, pp, cp=cp))
    result.ranked.sort(key=Candidate.sort_key)
    return result


def _search_split(model: ModelSpec, cluster: Cluster, workload: Workload, space: SearchSpace, result: SearchResult,
                  split: Layout) -> None:
    """Estimate every layout of one (dp, cp, tp, pp) split into `result`."""
    world, (dp, tp, pp, cp) = cluster.num_gpus, (split.dp, split.tp, split.pp, split.cp)
    why = [p for p in layout_problems(model, split, replace(workload, global_batch=dp), world)]
    if why:
        result.invalid.append((split, why))
        return
    for layout in _layouts(dp, tp, pp, workload, space, cp):
        if layout_problems(model, layout, workload, world):
            continue
        est = estimate(model, layout, cluster, workload)
        if est.fits:
            result.ranked.append(Candidate(layout, est, _why_rank(est)))
        else:
            result.too_big.append(Candidate(layout, est, _why_too_big(est)))


def micro_batch_choices(layout: Layout, workload: Workload) -> list[int]:
    """Micro-batch sizes that divide each data-parallel rank's share of the global batch, largest first."""
    per_rank, rem = divmod(workload.global_batch, layout.data_parallel)
    if rem or per_rank < 1:
        return []
    return [m for m in range(per_rank, 0, -1) if per_rank % m == 0]


def fit_micro_batch(model: ModelSpec, layout: Layout, cluster: Cluster, workload: Workload,
                    state=None) -> Estimate:
    """The layout's micro-batch chosen where the config or paper leaves it open, with a note
    saying which (`Estimate.notes`): without a pipeline the largest that fits (the fastest:
    larger GEMMs, fewer steps); with one the fastest that fits, since a larger micro-batch
    also means fewer micro-batches per step and a longer bubble (ties go to the larger).
    When none fits, the smallest one's estimate, with the bytes by category that do not fit."""
    choices = micro_batch_choices(layout, workload)
    if not choices:
        return estimate(model, layout, cluster, workload, state)
    fitting, smallest = [], None
    for mb in choices:
        est = estimate(model, replace(layout, micro_batch=mb), cluster, workload, state)
        if est.fits:
            fitting.append(est)
            if layout.pp == 1:
                break
        smallest = est
    per_rank = workload.global_batch // layout.data_parallel
    if fitting:
        best = max(fitting, key=lambda e: (e.time.tokens_per_s, e.layout.micro_batch))
        why = ("the largest that fits" if layout.pp == 1 else
               f"the fastest of the {len(fitting)} that fit (a pipeline's bubble grows with the micro-batch)")
        note = (f"micro-batch {best.layout.micro_batch} chosen: {why}; the {per_rank} sequences per data-parallel "
                f"rank allow {', '.join(map(str, choices))}")
        return replace(best, notes=[*best.notes, note])
    m = smallest.memory
    parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in {**m.states.as_dict(), "activations": m.activations,
                                                       "buffers": m.comm_buffers,
                                                       "fragmentation": m.fragmentation}.items())
    return replace(smallest, notes=[*smallest.notes, f"no micro-batch fits: even micro-batch 1 needs "
                                    f"{m.device_total / GiB:.2f} GiB of {m.capacity / GiB:.1f} GiB ({parts} GiB)"])
