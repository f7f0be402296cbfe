"""`trident checkpoint inspect`: what a checkpoint holds, read from its manifest alone."""

from __future__ import annotations

from pathlib import Path

from trident.checkpointing.files import CheckpointError, read_manifest, sha256_of

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "uint8": 1,
                "int8": 1, "bool": 1}


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _origin(src: dict) -> str:
    """Where a resharded or imported checkpoint came from: another trident layout, or another
    framework's checkpoint (`{"deepspeed": {"kind": ..., "dp": ..., ...}}`, written by import)."""
    if "pp" in src:
        return f"resharded from pp {src['pp']} x dp {src['dp']} x tp {src['tp']}, ZeRO stage {src.get('zero_stage', 0)}"
    framework, layout = next(iter(src.items())) if len(src) == 1 else ("another framework", src)
    name = {"deepspeed": "DeepSpeed"}.get(framework, framework)
    if not isinstance(layout, dict):
        return f"imported from a {name} checkpoint"
    parts = [f"{k} {layout[k]}" for k in ("pp", "dp", "tp") if k in layout]
    kind = f" {layout['kind']}" if "kind" in layout else ""
    return f"imported from a {name}{kind} checkpoint" + (f" ({' x '.join(parts)})" if parts else "")


def describe(folder: Path, verify: bool = False) -> str:
    """A report of the layout, every tensor and every file (checksums compared when `verify`)."""
    manifest = read_manifest(folder)
    layout = manifest["layout"]
    lines = [f"checkpoint {folder}", f"  step {manifest.get('global_steps', '?')}, format {manifest['format_version']}",
             f"  layout: pp {layout['pp']} x dp {layout['dp']} x tp {layout['tp']} = {layout['world_size']} ranks, "
             f"ZeRO stage {layout.get('zero_stage', 0)}"]
    if manifest.get("resharded_from"):
        lines.append(f"  {_origin(manifest['resharded_from'])}")
    tensors = manifest["tensors"]
    width = max((len(n) for n in tensors), default=4)
    lines += ["", f"  {'tensor':<{width}}  {'global shape':<16} {'dtype':<9} {'split':<22} pieces"]
    total = 0
    for name, entry in tensors.items():
        shape = entry.get("global_shape", [])
        numel = 1
        for d in shape:
            numel *= d
        total += numel * _DTYPE_BYTES.get(entry.get("dtype", ""), 4)
        split = entry.get("tp_split")
        how = f"tp dim {split['dim']}" + (f" stride {split['stride']}" if split.get("stride", 1) > 1 else "") \
            if split else "replicated"
        shards = entry.get("shards", [])
        stages = sorted({s["pp"] for s in shards})
        if len(stages) > 1:
            how += f", stages {','.join(map(str, stages))}"
        lines.append(f"  {name:<{width}}  {'x'.join(map(str, shape)) or 'scalar':<16} {entry.get('dtype', '?'):<9} "
                     f"{how:<22} {len(shards)}")
    for alias, name in manifest.get("tied", {}).items():
        lines.append(f"  {alias:<{width}}  tied to {name}")
    lines += ["", f"  {len(tensors)} tensors, {_size(total)} in the model's dtype", "",
              f"  {'file':<34} {'size':>10}  sha256"]
    bad = []
    for name, entry in manifest["files"].items():
        status = entry["sha256"][:12]
        if verify:
            path = folder / name
            if not path.exists():
                status, _ = "MISSING", bad.append(name)
            elif sha256_of(path) != entry["sha256"]:
                status, _ = "MISMATCH", bad.append(name)
            else:
                status += " ok"
        lines.append(f"  {name:<34} {_size(entry.get('bytes', 0)):>10}  {status}")
    size = sum(e.get("bytes", 0) for e in manifest["files"].values())
    lines.append(f"  {len(manifest['files'])} files, {_size(size)}")
    if bad:
        raise CheckpointError("\n".join(lines) + f"\n{folder}: damaged files: {', '.join(bad)}; load another tag")
    return "\n".join(lines)
