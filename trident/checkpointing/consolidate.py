"""One plain fp32 state dict from a checkpoint, without a process group.

A checkpoint holds each tensor in pieces: pipeline stages, tensor-parallel slices and, under
ZeRO, each rank's flat partition (`zero_pp<P>_tp<T>_dp<D>.pt`). Consolidation reads them through
`trident.checkpointing.reshard.CheckpointReader` (every file verified against the manifest's
checksum) and writes each tensor whole: parameters as their fp32 masters, buffers as saved,
tied aliases restored from the manifest.

DeepSpeed's names: `get_fp32_state_dict_from_zero_checkpoint(dir, tag=None)` and
`load_state_dict_from_zero_checkpoint(model, dir, tag=None)`; on the command line,
`trident checkpoint consolidate CKPT_DIR OUT`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from trident.checkpointing.reshard import CheckpointReader
from trident.checkpointing.files import MANIFEST, CheckpointError, resolve_tag


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
        raise CheckpointError(f"{folder / MANIFEST}: missing; {folder} is not a complete trident checkpoint"
                              + (DEEPSPEED_HINT.format(root=root) if _looks_like_deepspeed(folder) else ""))
    return folder


DEEPSPEED_HINT = ("; it holds a DeepSpeed checkpoint: `trident checkpoint inspect` and `consolidate` read it as it "
                  "is, and `trident checkpoint import-deepspeed {root} OUT` converts it (engine.load_checkpoint "
                  "reads it too)")


def _looks_like_deepspeed(folder: Path) -> bool:
    """DeepSpeed's file names: mp_rank_XX_model_states.pt, or a pipeline's layer_XX-model_states.pt."""
    return any(folder.glob("*model_states.pt"))


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | Path, tag: str | None = None
                                             ) -> dict[str, torch.Tensor]:
    """Every entry of the model's state dict, whole (tp slices merged, pipeline stages joined),
    parameters as their fp32 masters, from a checkpoint on disk written under any layout."""
    reader = CheckpointReader(checkpoint_folder(checkpoint_dir, tag))
    state = {name: reader.value(name) for name in reader.tensors if name not in reader.tied}
    for alias, name in reader.tied.items():
        state[alias] = state[name]
    return {k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}


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
    write_state_dict(state, out)
    return out


def write_state_dict(state: dict[str, torch.Tensor], out: Path) -> None:
    """`state` to `out` atomically (a temporary file, then a rename): torch.save for .pt/.bin/.pth,
    else safetensors with tied entries stored once."""
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
