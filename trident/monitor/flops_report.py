"""The FLOPs profiler's report, DeepSpeed's kind: summary, aggregated profile, per-module profile.

Every rank profiles what it computes (`trident.monitor.flops_profiler.FlopsProfiler.rank_profile`);
`merge` adds them up for one replica of the model (the ranks with data-parallel rank 0 and
expert-parallel rank 0): FLOPs sum over its tensor-, pipeline- and context-parallel ranks, which
each compute a part of the same step; tensor-parallel shards of a parameter sum, replicated
parameters count once; a module's latency is its slowest rank's (they run side by side), the
model's forward the sum of its pipeline stages' (one after another); tokens are the
most any rank fed in (tp and cp ranks all see the same token ids, pipeline stages after the
first see activations). Data-parallel replicas repeat the same work on other samples, so the
figures are per replica and per GPU (a replica's over its ranks), as DeepSpeed's "per GPU".
`render` writes the text, `emit` prints it or writes the output file.
"""

from __future__ import annotations

import sys
from pathlib import Path

DEFAULT_PRECISION = 2
LINE = "{:<70}  {}"


# -- numbers, as DeepSpeed writes them ------------------------------------------------------------

def number_to_string(num: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """`1234567` -> "1.23 M"; `units` forces one of T, G, M, K, m, u (or "" for none)."""
    scales = {"T": 1e12, "G": 1e9, "M": 1e6, "K": 1e3, "": 1.0, "m": 1e-3, "u": 1e-6}
    if units is None:
        units = next((u for u, s in scales.items() if abs(num) >= s), "u")
        if num == 0:
            units = ""
    return f"{round(num / scales.get(units, 1.0), precision):g} {units}"


def macs_to_string(macs: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(macs, units, precision)}MACs"


def flops_to_string(flops: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(flops, units, precision)}FLOPS"


def params_to_string(params: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """Parameters: "1.5 B" for 1.5e9 (B, not G)."""
    units = units.replace("B", "G") if units else units
    return number_to_string(params, units, precision).replace("G", "B").strip()


def duration_to_string(seconds: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(seconds, units, precision)}s"


def _pct(part: float, whole: float) -> str:
    return f"{round(100 * part / whole, DEFAULT_PRECISION):g}%" if whole else "0%"


# -- adding the ranks up ---------------------------------------------------------------------------

def merge(ranks: list[dict]) -> dict:
    """One replica's figures from every rank's `rank_profile` (each with `coords`: dp, tp, pp,
    cp, ep ranks; missing = 0). The module `""` stands for the whole replica."""
    def at(r: dict, axis: str) -> int:
        return r["coords"].get(axis, 0)

    replica = sorted((r for r in ranks if at(r, "dp") == 0 and at(r, "ep") == 0),
                     key=lambda r: (at(r, "pp"), at(r, "cp"), at(r, "tp")))
    modules: dict[str, dict] = {}
    for r in replica:
        for name, kind, depth, split, replicated, flops, seconds, calls in r["modules"]:
            m = modules.setdefault(name, {"name": name, "kind": kind, "depth": depth, "params": 0, "replicated": 0,
                                          "flops": 0, "seconds": 0.0, "calls": 0})
            m["params"] += split if at(r, "cp") == 0 else 0
            m["replicated"] = max(m["replicated"], replicated)
            m["flops"] += flops
            m["seconds"] = max(m["seconds"], seconds)
            m["calls"] = max(m["calls"], calls)
    stages: dict[int, int] = {}
    stage_seconds: dict[int, float] = {}
    for r in replica:  # replicated parameters once per pipeline stage; the stages' forwards one after another
        stages[at(r, "pp")] = max(stages.get(at(r, "pp"), 0), r["root_params"][1])
        stage_seconds[at(r, "pp")] = max(stage_seconds.get(at(r, "pp"), 0.0), r["forward_seconds"])
    for m in modules.values():
        m["params"] += m.pop("replicated")
    forward = sum(r["forward"] for r in replica)
    root = modules[""]
    root.update(params=sum(r["root_params"][0] for r in replica if at(r, "cp") == 0) + sum(stages.values()),
                flops=forward, seconds=sum(stage_seconds.values()))
    phases: dict[str, float] = {}
    for r in replica:
        for phase, seconds in r.get("phases", {}).items():
            phases[phase] = max(phases.get(phase, 0.0), seconds)
    return {"modules": modules, "forward": forward, "backward": sum(r["backward"] for r in replica),
            "recompute": sum(r["recompute"] for r in replica), "tokens": max(r["tokens"] for r in replica),
            "replica_ranks": len(replica), "world": len(ranks), "phases": phases,
            "iter_seconds": max(r.get("iter_seconds", 0.0) for r in replica),
            "local_params": ranks[0]["root_params"], "per_rank": [_rank_row(r) for r in ranks]}


def _rank_row(r: dict) -> dict:
    return {"coords": r["coords"], "forward": r["forward"], "backward": r["backward"],
            "iter_seconds": r.get("iter_seconds", 0.0), "tokens": r["tokens"]}


def training_flops(profile: dict, recompute_fwd_factor: float = 0.0) -> tuple[int, int]:
    """(counted FLOPs, model FLOPs) of the replica's step: counted = forward + backward as they
    ran; model = counted less recomputation (measured where modules re-ran in backward, else
    `recompute_fwd_factor` x forward, DeepSpeed's estimate)."""
    counted = profile["forward"] + profile["backward"]
    recompute = profile["recompute"] or recompute_fwd_factor * profile["forward"]
    return counted, int(counted - min(recompute, profile["backward"]))


# -- the text -----------------------------------------------------------------------------------------

NOTATIONS = """Notations:
data parallel size (dp_size), tensor parallel size (tp_size), pipeline parallel size (pp_size),
a replica (the tp x pp x cp ranks that hold one copy of the model; dp replicas repeat its work on other samples),
number of parameters (params), number of multiply-accumulate operations (MACs),
number of floating-point operations (flops), floating-point operations per second (FLOPS),
fwd latency (forward propagation latency), bwd latency (backward propagation latency),
step (weights update latency), iter latency (the profiled optimizer step: every micro-batch's fwd and bwd, and step)
"""


def render(profile: dict, step: int, module_depth: int = -1, top_modules: int = 1, detailed: bool = True,
           recompute_fwd_factor: float = 0.0, layout: dict | None = None,
           peak: tuple[float, str] | None = None, device: str = "") -> str:
    """The whole report. `layout`: the run's sizes (world, dp, tp, pp, cp, ep, micro_batch,
    gradient_accumulation_steps); `peak`: (FLOP/s per device, its source) for the MFU."""
    lines = ["", "-------------------------- DeepSpeed Flops Profiler --------------------------",
             f"Profile Summary at step {step}:", NOTATIONS]
    lines += _layout_lines(profile, layout or {})
    lines += _summary_lines(profile, recompute_fwd_factor, peak, device)
    if profile["world"] > 1:
        lines += ["", "----------------------------- Per rank -----------------------------"]
        lines += _rank_lines(profile)
    lines += ["", "----------------------------- Aggregated Profile per replica -----------------------------"]
    lines += aggregated_lines(profile, module_depth, top_modules)
    if detailed:
        lines += ["", "------------------------------ Detailed Profile per replica ------------------------------",
                  "Each module profile is listed after its name in the following order:",
                  "params, percentage of total params, MACs, percentage of total MACs, fwd latency, percentage of "
                  "total fwd latency and of the iter latency, fwd FLOPS", "",
                  "Note: 1. FLOPs are counted by torch.utils.flop_counter: matrix multiplies, convolutions and "
                  "attention; element-wise work counts nothing. MACs are half the FLOPs.",
                  "2. A module's figures include its children's; work in functions outside any module (a "
                  "pipeline's tied output layer) is listed apart.",
                  "3. The fwd latency is timed by hooks around each module's forward; a replica's module takes "
                  "its slowest rank's time.", ""]
        lines += detailed_lines(profile, module_depth, _iter_seconds(profile))
    lines.append("------------------------------------------------------------------------------")
    return "\n".join(lines) + "\n"


def _iter_seconds(profile: dict) -> float:
    return profile["iter_seconds"] or sum(profile["phases"].values())


def _layout_lines(profile: dict, layout: dict) -> list[str]:
    lines = [LINE.format("world size: ", layout.get("world", profile["world"]))]
    for key, label in (("dp", "data parallel size"), ("tp", "tensor parallel size"), ("pp", "pipeline parallel size"),
                       ("cp", "context parallel size"), ("ep", "expert parallel size")):
        if key in layout and (key in ("dp", "tp", "pp") or layout[key] > 1):
            lines.append(LINE.format(f"{label}: ", layout[key]))
    lines.append(LINE.format("ranks per replica: ", profile["replica_ranks"]))
    if "micro_batch" in layout:
        lines.append(LINE.format("batch size per GPU: ", layout["micro_batch"]))
        lines.append(LINE.format("gradient accumulation steps: ", layout.get("gradient_accumulation_steps", 1)))
    lines.append(LINE.format("tokens per iter per replica: ", profile["tokens"]))
    return lines


def _summary_lines(profile: dict, factor: float, peak: tuple[float, str] | None, device: str) -> list[str]:
    n, fwd, bwd = profile["replica_ranks"], profile["forward"], profile["backward"]
    params = profile["modules"][""]["params"]
    split, replicated = profile["local_params"]
    phases, iter_s = profile["phases"], _iter_seconds(profile)
    counted, model = training_flops(profile, factor)
    tokens = profile["tokens"]
    out = [LINE.format("params per GPU (rank 0): ", params_to_string(split + replicated)),
           LINE.format("params of model (one replica): ", params_to_string(params)),
           LINE.format("fwd MACs per GPU: ", macs_to_string(fwd / n / 2)),
           LINE.format("fwd flops per GPU: ", number_to_string(fwd / n)),
           LINE.format("fwd flops of model (one replica): ", number_to_string(fwd)),
           LINE.format("bwd flops of model (counted, recomputation included): ", number_to_string(bwd))]
    if profile["recompute"] or factor:
        recompute = counted - model
        how = "measured" if profile["recompute"] else f"recompute_fwd_factor {factor:g} x fwd"
        out.append(LINE.format(f"recomputed fwd flops ({how}): ", number_to_string(recompute)))
    fwd_s = profile["modules"][""]["seconds"]
    out.append(LINE.format("fwd latency: ", duration_to_string(fwd_s)))
    if fwd_s:
        out.append(LINE.format("fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ", flops_to_string(fwd / n / fwd_s)))
    for phase, label in (("forward", "fwd phase latency (engine.forward)"), ("backward", "bwd latency"),
                         ("pipeline", "fwd+bwd latency (pipeline schedule)"), ("step", "step latency")):
        if phase in phases:
            out.append(LINE.format(f"{label}: ", duration_to_string(phases[phase])))
    if iter_s:
        out.append(LINE.format("iter latency: ", duration_to_string(iter_s)))
    if tokens:
        out.append(LINE.format("flops per token, fwd+bwd as counted: ", number_to_string(counted / tokens)))
        out.append(LINE.format("model flops per token (without recomputation): ", number_to_string(model / tokens)))
    if iter_s:
        achieved = model / n / iter_s
        out.append(LINE.format("achieved FLOPS per GPU = model flops per GPU / iter latency: ",
                               f"{achieved / 1e12:.4g} TFLOP/s"))
        if peak is not None:
            out.append(LINE.format("MFU = achieved / peak: ", f"{100 * achieved / peak[0]:.2f}% of "
                                                             f"{peak[0] / 1e12:.4g} TFLOP/s ({peak[1]})"))
            out.append(LINE.format("HFU (recomputation included): ", f"{100 * counted / n / iter_s / peak[0]:.2f}%"))
        else:
            out.append(LINE.format("MFU: ", f"n/a (no peak FLOP/s known for {device or 'this device'}; on a CPU, "
                                            "`trident plan --calibrate` measures one)"))
        if tokens:
            out.append(LINE.format("tokens/second per replica: ", f"{tokens / iter_s:.6g}"))
    return out


def _rank_lines(profile: dict) -> list[str]:
    out = ["rank coordinates                fwd flops     bwd flops     iter latency   tokens"]
    for i, row in enumerate(profile["per_rank"]):
        where = " ".join(f"{k}{v}" for k, v in row["coords"].items() if k != "rank")
        out.append(f"{row['coords'].get('rank', i):<5}{where:<27}{number_to_string(row['forward']):<14}"
                   f"{number_to_string(row['backward']):<14}{duration_to_string(row['iter_seconds']):<15}"
                   f"{row['tokens']}")
    return out


def aggregated_lines(profile: dict, module_depth: int = -1, top_modules: int = 1) -> list[str]:
    """DeepSpeed's "top modules": per depth, the module types with the most parameters, MACs
    and forward latency (each type's modules at that depth summed)."""
    by_depth: dict[int, dict[str, list[float]]] = {}
    for m in profile["modules"].values():
        kinds = by_depth.setdefault(m["depth"], {})
        total = kinds.setdefault(m["kind"], [0, 0, 0.0])
        total[0] += m["params"]
        total[1] += m["flops"] / 2
        total[2] += m["seconds"]
    deepest = max(by_depth)
    last = deepest if module_depth < 0 else min(module_depth, deepest)
    out = [f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:"]
    for depth in range(last + 1):
        kinds = by_depth.get(depth, {})

        def top(i: int, fmt) -> dict[str, str]:
            ranked = sorted(kinds.items(), key=lambda kv: kv[1][i], reverse=True)[:top_modules]
            return {k: fmt(v[i]) for k, v in ranked}
        out += [f"depth {depth}:", f"    params      - {top(0, params_to_string)}",
                f"    MACs        - {top(1, macs_to_string)}", f"    fwd latency - {top(2, duration_to_string)}"]
    return out


def detailed_lines(profile: dict, module_depth: int, iter_seconds: float) -> list[str]:
    """One line per module down to `module_depth` (-1: all), indented by depth, in model order."""
    modules = profile["modules"]
    root = modules[""]
    total_params, total_macs, total_s = root["params"], root["flops"] / 2, root["seconds"]
    out = []
    for m in modules.values():
        if 0 <= module_depth < m["depth"]:
            continue
        macs, seconds = m["flops"] / 2, m["seconds"]
        rate = flops_to_string(m["flops"] / seconds) if seconds else flops_to_string(0)
        share = f" ({_pct(seconds, iter_seconds)} of iter)" if iter_seconds else ""
        label = f"{m['name']} ({m['kind']})" if m["name"] else f"{m['kind']} (the model)"
        out.append(f"{'  ' * m['depth']}{label}: {params_to_string(m['params'])} = {_pct(m['params'], total_params)} "
                   f"Params, {macs_to_string(macs)} = {_pct(macs, total_macs)} MACs, {duration_to_string(seconds)} = "
                   f"{_pct(seconds, total_s)} latency{share}, {rate}")
        if m["depth"] == 0:
            outside = root["flops"] - sum(c["flops"] for c in modules.values() if c["depth"] == 1)
            if outside > 0 and module_depth != 0:
                out.append(f"  (functions outside any module): {macs_to_string(outside / 2)} = "
                           f"{_pct(outside / 2, total_macs)} MACs")
    return out


def emit(text: str, output_file: str | None) -> None:
    """Print the report, or write it to `output_file` (its folder made if missing)."""
    if not output_file:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    path = Path(output_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
