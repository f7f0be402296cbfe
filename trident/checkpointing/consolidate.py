"""One plain fp32 state dict from a checkpoint, without a process group.

A ZeRO checkpoint holds each rank's partition (`zero_pp<P>_tp<T>_dp<D>.pt`): its layout (units,
parameter names, shapes and offsets), its fp32 master shards and the optimizer state over them.
Consolidation reads every rank's file, verifies its checksum against the manifest, and puts each
parameter back together from the pieces each rank holds (trident.zero.partition says which).
Buffers and tied aliases come from `model.safetensors` and the manifest. A stage 0 checkpoint
consolidates too (its fp32 masters, or the model weights in fp32 training).

DeepSpeed's names: `get_fp32_state_dict_from_zero_checkpoint(dir, tag=None)` and
`load_state_dict_from_zero_checkpoint(model, dir, tag=None)`; on the command line,
`trident checkpoint consolidate CKPT_DIR OUT`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from trident.checkpointing.state import (MANIFEST, MODEL_FILE, CheckpointError, load_pickle, load_tensors,
                                        read_manifest, resolve_tag)
from trident.zero.partition import ShardedLayout


def checkpoint_folder(checkpoint_dir: str | Path, tag: str | None = None) -> Path:
    """The folder of one checkpoint: `checkpoint_dir` itself if it holds a manifest, else its
    `tag` (default: the one named in `latest`)."""
    root = Path(checkpoint_dir)
    if (root / MANIFEST).exists() and tag is None:
        return root
    tag = resolve_tag(str(root), tag)
    if tag is None:
        raise CheckpointError(f"{root}: no checkpoint here (no {MANIFEST} and no 'latest' file); pass the "
                              "folder given to save_checkpoint or one of its tag folders")
    folder = root / tag
    if not (folder / MANIFEST).exists():
        raise CheckpointError(f"{folder / MANIFEST}: missing; {folder} is not a complete trident checkpoint")
    return folder


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | Path, tag: str | None = None
                                             ) -> dict[str, torch.Tensor]:
    """Every entry of the model's state dict, parameters in fp32, from a checkpoint on disk."""
    folder = checkpoint_folder(checkpoint_dir, tag)
    manifest = read_manifest(folder)
    layout = manifest["layout"]
    if layout["tp"] != 1 or layout["pp"] != 1:
        raise CheckpointError(f"{folder}: written with tp={layout['tp']}, pp={layout['pp']}; this consolidation "
                              "reads data-parallel (ZeRO) checkpoints with tp=1 and pp=1")
    state = dict(load_tensors(folder, manifest, MODEL_FILE))
    stage = layout["zero_stage"]
    if stage == 0:
        state.update(_stage0_masters(folder, manifest))
    else:
        for dp in range(layout["dp"]):
            name = f"zero_pp0_tp0_dp{dp}.pt"
            part = load_pickle(folder, manifest, name)
            _add_partition(state, part, dp, layout["dp"], name)
        missing = [n for n, t in manifest["tensors"].items() if n not in state and n not in manifest.get("tied", {})]
        if missing:
            raise CheckpointError(f"{folder}: the partitions lack {', '.join(missing[:5])}; the checkpoint is "
                                  "incomplete")
    for alias, name in manifest.get("tied", {}).items():
        state[alias] = state[name]
    return {k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}


def _stage0_masters(folder: Path, manifest: dict) -> dict[str, torch.Tensor]:
    strategy = load_pickle(folder, manifest, "optim_pp0_tp0.pt")
    names, copies = strategy.get("names", []), strategy.get("master_params_are_copies", [])
    masters = iter(strategy.get("master_weights", []))
    return {name: next(masters) for name, is_copy in zip(names, copies) if is_copy}


def _add_partition(state: dict, part: dict, rank: int, world: int, file: str) -> None:
    if part.get("dp_world_size") != world or part.get("dp_rank") != rank:
        raise CheckpointError(f"{file}: holds dp rank {part.get('dp_rank')} of {part.get('dp_world_size')}, "
                              f"expected rank {rank} of {world}; the checkpoint is inconsistent")
    for group in part["groups"]:
        layout = ShardedLayout.from_dict(group["layout"])
        flat = torch.cat([m.reshape(-1).float() for m in group["masters"]]) if group["masters"] else torch.zeros(0)
        for unit in layout.units:
            lo, _ = unit.shard_range(rank)
            for slot, a, b in unit.pieces(rank):
                name = group["names"][slot.index]
                full = state.get(name)
                if full is None or full.shape != torch.Size(slot.shape) or full.dtype != torch.float32:
                    full = torch.zeros(slot.shape, dtype=torch.float32)
                    state[name] = full
                start = unit.partition_offset + slot.offset + a - lo
                full.view(-1)[a:b].copy_(flat[start:start + (b - a)])


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str | Path,
                                         tag: str | None = None) -> torch.nn.Module:
    """Load a checkpoint's consolidated fp32 weights into a plain (unpartitioned) model."""
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag))
    return model


def consolidate(checkpoint_dir: str | Path, out: str | Path, tag: str | None = None) -> Path:
    """Write the consolidated fp32 state dict to `out`: safetensors, or torch.save for .pt/.bin.

    Tied entries are stored once in safetensors (it refuses shared tensors) and restored on load
    by the model's own tying; a torch file keeps every key.
    """
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    out = Path(out)
    if out.is_dir():
        out = out / "model_fp32.safetensors"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    if out.suffix in (".pt", ".bin", ".pth"):
        torch.save(state, tmp)
    else:
        seen, unique = set(), {}
        for k, v in state.items():
            if id(v) not in seen:
                seen.add(id(v))
                unique[k] = v.contiguous()
        save_file(unique, str(tmp))
    tmp.replace(out)
    return out
