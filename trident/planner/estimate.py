"""`estimate(model, layout, cluster)`: memory, traffic and time of one layout, as one result.

The result holds the pieces (`memory`, `traffic`, `time`) as dataclasses for code, `format()`
for people (the text `trident plan --config` prints) and `to_dict()` for JSON.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from trident.planner.comm import Traffic, step_traffic
from trident.planner.compression import error_notes
from trident.planner.layout import Layout, Workload, attention_kind, grad_accumulation, layout_problems
from trident.planner.memory import (PLACE, MemoryEstimate, StateBytes, activation_memory, memory_estimate,
                                    mixed_precision_bytes, rank_parameter_counts)
from trident.planner.presets import Cluster, GiB, ModelSpec, model_preset
from trident.planner.time import TimeEstimate, step_time


@dataclass(frozen=True)
class Estimate:
    """Everything the planner predicts for one layout of one model on one cluster."""

    model: ModelSpec
    layout: Layout
    workload: Workload
    cluster: Cluster
    memory: MemoryEstimate
    traffic: list[Traffic]
    time: TimeEstimate
    problems: list[str]
    notes: list[str] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not self.problems

    @property
    def fits(self) -> bool:
        return self.memory.fits

    def activation_variants(self) -> dict[str, float]:
        """Activation bytes of this layout under each checkpointing choice, with and without
        sequence parallelism (when tp > 1)."""
        out = {}
        for sp in ((False, True) if self.layout.tp > 1 else (False,)):
            for ckpt in ("none", "selective", "full"):
                variant = replace(self.layout, activation_checkpointing=ckpt, sequence_parallel=sp)
                out[ckpt + (" + sp" if sp else "")] = activation_memory(self.model, variant, self.workload)
        return out

    def to_dict(self) -> dict:
        m = self.memory
        return {
            "model": self.model.name, "parameters": self.model.num_parameters(),
            "active_parameters": self.model.active_parameters(),
            "rank_parameters_trainable": rank_parameter_counts(self.model, self.layout, self.workload)[1],
            "layout": asdict(self.layout), "workload": asdict(self.workload),
            "cluster": {"gpu": self.cluster.gpu.name, "num_gpus": self.cluster.num_gpus,
                        "gpus_per_node": self.cluster.gpus_per_node},
            "problems": self.problems, "fits": self.fits,
            "memory_bytes": {**m.states.as_dict(), "activations": m.activations, "comm_buffers": m.comm_buffers,
                             "fragmentation": m.fragmentation, "device_total": m.device_total,
                             "capacity": m.capacity, "device": m.placement.device, "host": m.placement.host,
                             "nvme": m.placement.nvme},
            "activation_variants_bytes": self.activation_variants(),
            "traffic": [{**asdict(t), "bytes_per_step": t.bytes_per_step} for t in self.traffic],
            "time": asdict(self.time), "notes": self.notes,
        }

    def format(self) -> str:
        """A printable report: memory by kind and place, traffic per collective, time per cause."""
        return "\n".join(self._header() + [""] + self._memory_lines() + [""] + self._traffic_lines()
                         + [""] + self._time_lines())

    def _header(self) -> list[str]:
        c, w = self.cluster, self.workload
        gas = grad_accumulation(self.layout, w)
        lines = [f"model    {self.model.describe()}",
                 f"cluster  {c.num_gpus} x {c.gpu.name}, {c.gpus_per_node} per node ({c.num_nodes} nodes)",
                 f"layout   {self.layout.describe()}" + _cp_text(self.layout, w),
                 f"batch    {w.global_batch} sequences x {w.seq_len} tokens = {w.tokens_per_step():,} tokens per step"
                 + (f" ({gas} micro-batches of {self.layout.micro_batch} per rank)" if gas else ""),
                 f"format   {w.precision}{' + fp8 GEMMs' if w.fp8 else ''}, {w.optimizer}, "
                 f"{attention_kind(self.layout, w)} attention" + (", dropout" if w.dropout else "")]
        if w.lora_r:
            params, trainable = rank_parameter_counts(self.model, self.layout, w)
            lines.append(f"LoRA     r={w.lora_r} on {','.join(w.lora_targets)}: {trainable:,.0f} trainable of "
                         f"{params:,.0f} parameters per rank ({100 * trainable / params:.2f}%); the rest frozen")
        lines += [f"INVALID  {p}" for p in self.problems]
        lines += [f"note     {n}" for n in self.notes]
        return lines

    def _memory_lines(self) -> list[str]:
        m, p = self.memory, self.memory.placement
        g = lambda n: f"{n / GiB:10.2f}"  # noqa: E731
        par_at, opt_at = PLACE[self.layout.offload_params], PLACE[self.layout.offload_optimizer]
        rows = [("parameters", m.states.parameters, par_at), ("gradients", m.states.gradients, "device"),
                ("optimizer states (+ fp32 masters)", m.states.optimizer_states, opt_at),
                ("activations", m.activations, "device"), ("communication buffers", m.comm_buffers, "device"),
                ("fragmentation margin", m.fragmentation, "device")]
        lines = [f"memory per rank (GiB)               {'device':>10}{'host':>10}{'nvme':>10}"]
        for name, value, where in rows:
            cols = {k: (g(value) if k == where else f"{'':10}") for k in ("device", "host", "nvme")}
            lines.append(f"  {name:<34}{cols['device']}{cols['host']}{cols['nvme']}".rstrip())
        verdict = "fits" if m.fits else "DOES NOT FIT"
        lines.append(f"  {'total':<34}{g(m.device_total)}{g(p.host)}{g(p.nvme)}   "
                     f"of {m.capacity / GiB:.1f} GiB: {verdict}")
        variants = " | ".join(f"{k} {v / GiB:.2f}" for k, v in self.activation_variants().items())
        lines.append(f"  activations by checkpointing (GiB): {variants}")
        return lines

    def _traffic_lines(self) -> list[str]:
        lines = [f"communication per step, per rank  {'bytes/call':>10}{'calls':>8}{'bytes/step':>12}{'seconds':>10}"
                 "  on the critical path"]
        for t in self.traffic:
            lines.append(f"  {t.axis} {t.op:<29}{_human(t.bytes_per_call):>10}{t.calls:>8}"
                         f"{_human(t.bytes_per_step):>12}{t.seconds:>10.3f}  "
                         f"{_critical(t)}: {t.what}")
        if not self.traffic:
            lines.append("  (none: one rank)")
        return lines

    def _time_lines(self) -> list[str]:
        t = self.time
        return [f"time per step  {t.step:.3f} s = compute {t.compute:.3f} + tp {t.tp_comm:.3f} + pp {t.pp_comm:.3f}"
                + (f" + cp {t.cp_comm:.3f}" if self.layout.cp > 1 else "")
                + f" + dp exposed {t.dp_comm_exposed:.3f} + bubble {t.bubble:.3f} + optimizer {t.optimizer:.3f}",
                f"throughput     {t.tokens_per_s:,.0f} tokens/s ({t.tokens_per_s_per_gpu:,.1f} per GPU), "
                f"{t.model_flops_per_gpu / 1e12:.1f} model TFLOP/s per GPU, MFU {100 * t.mfu:.1f}%, "
                f"HFU {100 * t.hfu:.1f}%"] + self._gather_lines()

    def _gather_lines(self) -> list[str]:
        gathers = [x for x in self.traffic if x.axis == "dp" and x.phase in ("forward", "backward")]
        if not gathers:
            return []
        calls, seconds = sum(x.calls for x in gathers), sum(x.seconds for x in gathers)
        reduce = sum(x.seconds for x in self.traffic if x.axis == "dp" and x.op == "reduce_scatter")
        return [f"ZeRO-3         {calls} per-module gathers take {seconds:.3f} s (latency x calls + bytes / "
                f"bandwidth) and the gradient reduce-scatters {reduce:.3f} s; played out module by module, "
                f"{self.time.dp_comm_exposed:.3f} s of them exposed ({self.time.zero3_gathers_exposed:.3f} s "
                f"by the gathers alone) with a prefetch of {self.workload.zero3_prefetch_elems:,} elements"]


def _cp_text(layout: Layout, workload: Workload) -> str:
    if layout.cp <= 1:
        return ""
    method = workload.cp_method + (f", Ulysses groups of {workload.cp_ulysses_size}"
                                   if workload.cp_method == "hybrid" else "")
    return (f" (context parallel: {method}; {workload.seq_len // layout.cp:,} of {workload.seq_len:,} tokens of each "
            f"sequence per rank)")


def _critical(t: Traffic) -> str:
    """The traffic table's last column: whether a collective waits on the critical path."""
    if not t.overlapped:
        return "yes"
    if t.exposed:
        return f"overlapped, {t.exposed:.3f} s exposed"
    return "overlapped"


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def estimate(model: ModelSpec | str, layout: Layout, cluster: Cluster, workload: Workload | None = None,
             state: StateBytes | None = None) -> Estimate:
    """Predict memory, traffic and step time of `layout` for `model` on `cluster`.

    `workload` defaults to the model's sequence length and one micro-batch per data-parallel
    rank; `state` (bytes per parameter) to textbook mixed precision for the workload's format.
    An invalid layout still gets numbers; its `problems` say what is wrong.
    """
    spec = model_preset(model) if isinstance(model, str) else model
    workload = workload or Workload(seq_len=spec.seq_len, global_batch=layout.dp * layout.micro_batch)
    state = state or mixed_precision_bytes(workload.precision, workload.optimizer)
    problems = layout_problems(spec, layout, workload, cluster.num_gpus, even_stages=False)
    traffic = step_traffic(spec, layout, workload, cluster, state)
    return Estimate(spec, layout, workload, cluster, memory_estimate(spec, layout, workload, cluster, state),
                    traffic, step_time(spec, layout, workload, cluster, state, traffic), problems,
                    error_notes(workload.compression))
