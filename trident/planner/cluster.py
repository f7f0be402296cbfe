"""A cluster file: what `trident plan --calibrate` measured on this machine, as JSON.

    {"version": 2, "device": "cpu", "backend": "gloo", "world_size": 2, "threads": 1,
     "dtype": "float32", "gemm": {"ms": [...], "ns": [...], "ks": [...], "points": [[m, n, k, s], ...]},
     "memory_bandwidth": B/s, "elementwise_bandwidth": B/s, "op_seconds": s,
     "attention": [[head width, FLOP/s], ...],
     "optimizer": {"seconds_per_param": s, "seconds_per_tensor": s},
     "collectives": {"all_reduce": {"alpha": s, "beta": s/B, "world": 2}, ..., "p2p": {...}},
     "memory_bytes": B, "host": "...", "created": "...", "torch": "..."}

Each collective is fitted as t = alpha + beta x S on the `world` ranks it was measured on (S the
op's full buffer, as `trident.planner.comm` counts it). On a CPU, "reduce_scatter.in_step" and
"all_gather.in_step" are the same ops timed one call at a time after compute, as ZeRO-1/2 issue
them once a step (`calibrate.IN_STEP_ALSO`). For another group size n the ring's
step count and volume scale it: latency x steps(n) / steps(world), bandwidth x volume(n) /
volume(world). `calibrated_cluster` turns the file into a `Cluster` whose "GPU" is this device:
every prediction (`estimate`, `search`, `trident plan --cluster`) then uses the measured GEMM
table, bandwidths, per-op cost and collectives instead of a data sheet.

The default location is `$XDG_CACHE_HOME/trident/cluster.json` (`~/.cache/trident/cluster.json`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from trident.planner.gemm import GemmTable
from trident.planner.presets import Cluster, GPUSpec

FORMAT_VERSION = 2
"""2: the element-wise rate counts forward and backward, and fused attention has rates of its own."""
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "p2p")


def _steps_and_volume(op: str, n: int) -> tuple[float, float]:
    """Latency steps and the share of the buffer each rank moves, for a ring of n ranks."""
    if n <= 1:
        return 0.0, 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return float(n - 1), (n - 1) / n
    if op == "broadcast":  # pipelined chain
        return float(n - 1), 1.0
    return 1.0, 1.0  # p2p: one message


@dataclass(frozen=True)
class CollectiveFit:
    """t = alpha + beta x bytes for one op, measured on `world` ranks."""

    alpha: float
    beta: float
    world: int

    def seconds(self, op: str, size: float, n: int) -> float:
        steps, volume = _steps_and_volume(op, n)
        ref_steps, ref_volume = _steps_and_volume(op, self.world)
        if steps == 0.0:
            return 0.0
        return self.alpha * steps / ref_steps + self.beta * size * volume / ref_volume


@dataclass(frozen=True)
class Calibration:
    """Everything `--calibrate` measures; see the module docstring for the file."""

    device: str
    backend: str
    world_size: int
    threads: int
    dtype: str
    gemm: GemmTable
    memory_bandwidth: float
    elementwise_bandwidth: float
    op_seconds: float
    optimizer_seconds_per_param: float
    optimizer_seconds_per_tensor: float
    collectives: dict[str, CollectiveFit] = field(default_factory=dict)
    memory_bytes: int = 0
    host: str = ""
    created: str = ""
    torch: str = ""
    attention_rates: tuple[tuple[int, float], ...] = ()

    def collective(self, op: str) -> CollectiveFit | None:
        return self.collectives.get(op)

    def to_json(self) -> dict:
        data = {k: v for k, v in asdict(self).items() if k not in ("gemm", "collectives", "attention_rates")}
        opt = {"seconds_per_param": data.pop("optimizer_seconds_per_param"),
               "seconds_per_tensor": data.pop("optimizer_seconds_per_tensor")}
        return {"version": FORMAT_VERSION, **data, "optimizer": opt, "gemm": self.gemm.to_json(),
                "collectives": {op: asdict(fit) for op, fit in self.collectives.items()},
                "attention": [list(p) for p in self.attention_rates]}

    @classmethod
    def from_json(cls, data: dict, source: str = "cluster file") -> Calibration:
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"{source}: version {data.get('version')!r} is not {FORMAT_VERSION}; calibrate again "
                             f"with `trident plan --calibrate`")
        try:
            fits = {op: CollectiveFit(float(f["alpha"]), float(f["beta"]), int(f["world"]))
                    for op, f in data.get("collectives", {}).items()}
            return cls(str(data["device"]), str(data["backend"]), int(data["world_size"]), int(data["threads"]),
                       str(data["dtype"]), GemmTable.from_json(data["gemm"]), float(data["memory_bandwidth"]),
                       float(data["elementwise_bandwidth"]), float(data["op_seconds"]),
                       float(data["optimizer"]["seconds_per_param"]), float(data["optimizer"]["seconds_per_tensor"]),
                       fits, int(data.get("memory_bytes", 0)), str(data.get("host", "")),
                       str(data.get("created", "")), str(data.get("torch", "")),
                       tuple((int(d), float(r)) for d, r in data.get("attention", [])))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{source}: not a trident cluster file ({type(err).__name__}: {err}); calibrate "
                             f"again with `trident plan --calibrate`") from None

    def describe(self) -> str:
        ar = self.collectives.get("all_reduce")
        rates = dict(self.attention_rates)
        attention = (f", fused attention {min(rates.values()) / 1e9:.0f}-{max(rates.values()) / 1e9:.0f} GFLOP/s "
                     f"(head width {min(rates)}-{max(rates)})" if rates else "")
        comm = (f"; {self.backend} all_reduce alpha {ar.alpha * 1e6:.0f} us, {1 / ar.beta / 1e9:.2f} GB/s on "
                f"{ar.world} ranks" if ar else "")
        return (f"{self.device} ({self.host or 'this machine'}, {self.threads} thread(s), {self.dtype}): GEMM up to "
                f"{self.gemm.peak / 1e9:.1f} GFLOP/s, copy {self.memory_bandwidth / 1e9:.1f} GB/s, element-wise "
                f"{self.elementwise_bandwidth / 1e9:.1f} GB/s, {self.op_seconds * 1e6:.1f} us per op{attention}{comm}")


def default_cluster_path() -> Path:
    """`$XDG_CACHE_HOME/trident/cluster.json`, else `~/.cache/trident/cluster.json`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "trident" / "cluster.json"


def save_calibration(cal: Calibration, path: str | Path | None = None) -> Path:
    target = Path(path) if path is not None else default_cluster_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(cal.to_json(), indent=1) + "\n")
    return target


def load_calibration(path: str | Path | None = None) -> Calibration:
    source = Path(path) if path is not None else default_cluster_path()
    if not source.is_file():
        raise ValueError(f"no cluster file at {source}; write one with `trident plan --calibrate` (or pass "
                         f"--cluster FILE)")
    try:
        data = json.loads(source.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{source}: not JSON ({err}); calibrate again with `trident plan --calibrate`") from None
    return Calibration.from_json(data, str(source))


def calibrated_gpu(cal: Calibration) -> GPUSpec:
    """This device as a GPUSpec: measured GEMM table and fused-attention rates, element-wise
    bandwidth (efficiency 1: it is already what the kernels sustain), copies for host
    transfers, the per-op cost; links from the all-reduce fit (the collectives themselves are
    priced from their own fits)."""
    ar = cal.collectives.get("all_reduce") or CollectiveFit(50e-6, 1 / 1e9, 2)
    link_bw = 1.0 / ar.beta
    memory = cal.memory_bytes or 16 * 1024**3
    return GPUSpec(f"calibrated-{cal.device}", cal.gemm.peak, memory, cal.elementwise_bandwidth, link_bw, link_bw,
                   cal.memory_bandwidth, gpus_per_node=max(1, cal.world_size), intra_node_latency=ar.alpha,
                   inter_node_latency=ar.alpha, gemm_efficiency=1.0, memory_efficiency=1.0,
                   kernel_seconds=cal.op_seconds, gemm_table=cal.gemm, attention_rates=cal.attention_rates,
                   host_op_seconds=cal.op_seconds if cal.device.startswith("cuda") else 0.0)


def calibrated_cluster(cal: Calibration, num_gpus: int | None = None, gpus_per_node: int | None = None) -> Cluster:
    """A Cluster of `num_gpus` ranks of the calibrated device (default: the ranks it was measured on)."""
    gpu = calibrated_gpu(cal)
    n = num_gpus or cal.world_size
    per_node = gpus_per_node or max(n, cal.world_size)
    return Cluster(replace(gpu, gpus_per_node=per_node), n, per_node, host_memory_bytes=gpu.memory_bytes,
                   calibration=cal)


__all__ = ["COLLECTIVES", "Calibration", "CollectiveFit", "calibrated_cluster", "calibrated_gpu",
           "default_cluster_path", "load_calibration", "save_calibration"]
