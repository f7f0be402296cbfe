"""The peak FLOP/s an MFU is measured against: a GPU's data-sheet preset, or a CPU's calibration.

A CUDA device's name (as torch reports it) picks its preset in `presets.GPU_PRESETS` (dense
16-bit tensor-core peak). A CPU has no data sheet here: its peak is the best GEMM rate `trident
plan --calibrate` measured on this machine, when the cluster file holds one for a CPU.
"""

from __future__ import annotations

from pathlib import Path

from trident.planner.cluster import default_cluster_path, load_calibration
from trident.planner.presets import GPU_PRESETS


def gpu_preset_name(device_name: str, total_memory: int) -> str | None:
    """The planner's preset for a CUDA device name (as torch reports it), or None."""
    name = device_name.upper()
    gib = total_memory / 2**30
    for marker, preset in (("H200", "h200-141gb"), ("H100", "h100-80gb"), ("V100", "v100-32gb")):
        if marker in name:
            return preset
    if "A100" in name:
        return "a100-80gb" if gib > 48 else "a100-40gb"
    return None


def device_peak(device_type: str, device_name: str = "", total_memory: int = 0,
                cluster_file: str | Path | None = None) -> tuple[float, str] | None:
    """(peak FLOP/s per device, where the figure comes from), or None when there is none."""
    if device_type == "cuda":
        preset = gpu_preset_name(device_name, total_memory)
        if preset is None:
            return None
        return GPU_PRESETS[preset].peak_flops, f"{preset} dense 16-bit peak (trident.planner presets)"
    path = Path(cluster_file) if cluster_file is not None else default_cluster_path()
    if not path.is_file():
        return None
    try:
        cal = load_calibration(path)
    except (ValueError, KeyError, TypeError):
        return None
    if not cal.device.startswith(device_type):
        return None
    return cal.gemm.peak, f"best GEMM rate calibrated on this {cal.device} ({path})"
