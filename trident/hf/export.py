"""Export to the folder `transformers`' `from_pretrained` reads, from any layout.

The folder holds `config.json` (and `generation_config.json` when the model has one) and the
weights: `model.safetensors`, or `model-0000x-of-0000y.safetensors` with
`model.safetensors.index.json` when they exceed `max_shard_size`. Tensor names are the
transformers model's own state-dict names (a wrapper around it, such as a module returning the
loss, is stripped), every tensor whole: ZeRO-3 partitions gathered, tensor-parallel slices
merged by their `ShardSpec` (fused q|k|v blocks, GPT-2's transposed `Conv1D` along its own
dim, the vocabulary padding stripped). Tied weights are written once, under the name
transformers keeps (the first in the state dict, e.g. `model.embed_tokens.weight`; the tied
`lm_head.weight` is left out, `from_pretrained` ties it again).

- `save_pretrained(engine, out)` (`engine.save_pretrained`): collective; tensors are gathered
  one output file at a time, so no rank holds more than one file's worth of whole tensors;
  mesh rank 0 writes.
- `export_checkpoint(ckpt, out)` (`trident checkpoint export-hf`): from a trident checkpoint on
  disk, with no process group; the manifest's `hf` record (written by `save_checkpoint` for a
  model holding a transformers model: its adapter's `export_record`) gives the config and the
  name prefix.

Nothing here imports trident in the exported folder: plain safetensors and JSON.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from trident.models.transformers.export import config_dict, generation_config
from trident.parallel.adapter import adapter_for

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
DEFAULT_MAX_SHARD = "5GB"


# -- the transformers model inside a trident model ---------------------------------------------

def export_root(module: nn.Module) -> tuple[str, nn.Module] | None:
    """(name, module) of the model an export of `module` writes (the outermost transformers
    PreTrainedModel inside it), as its family's adapter says; None when there is none."""
    adapter = adapter_for(module)
    return adapter.export_root() if adapter is not None else None


def export_record(module: nn.Module) -> dict | None:
    """What a checkpoint's manifest records so that `export_checkpoint` can write the folder (the
    family's `ModelAdapter.export_record`); None when the model holds no exportable model."""
    adapter = adapter_for(module)
    return adapter.export_record() if adapter is not None else None


# -- writing the folder --------------------------------------------------------------------------

def parse_size(size: int | str) -> int:
    """Bytes of `size`: an int, or "5GB" / "200MB" / "10KiB" (transformers' convention: GB = 10^9)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(I?B)?\s*", str(size).upper())
    if m is None:
        raise ValueError(f"max_shard_size={size!r}: give bytes as an int or a string like '5GB', '200MB'")
    base = 1024 if (m.group(3) or "") == "IB" else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(m.group(2) or " "))


def plan_files(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Names grouped into files of at most `max_bytes` (a larger tensor gets a file of its own),
    in order."""
    files: list[list[str]] = [[]]
    used = 0
    for name, n in sizes:
        if files[-1] and used + n > max_bytes:
            files.append([])
            used = 0
        files[-1].append(name)
        used += n
    return [f for f in files if f]


def file_names(count: int) -> list[str]:
    if count == 1:
        return [SAFE_WEIGHTS]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _replace(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


class FolderWriter:
    """Writes the weight files one at a time, then the index and the configs."""

    def __init__(self, out: str | Path, groups: list[list[str]]) -> None:
        self.out = Path(out)
        self.groups = groups
        self.names = file_names(len(groups))
        self.weight_map: dict[str, str] = {}
        self.total = 0
        self.out.mkdir(parents=True, exist_ok=True)
        for stale in list(self.out.glob("model-*-of-*.safetensors")) + [self.out / SAFE_WEIGHTS, self.out / SAFE_INDEX]:
            if stale.exists():
                stale.unlink()

    def write(self, i: int, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file
        name = self.names[i]
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        _replace(self.out / name, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
        for k, v in tensors.items():
            self.weight_map[k] = name
            self.total += v.numel() * v.element_size()

    def finish(self, config: dict, generation_config: dict | None = None) -> Path:
        if len(self.names) > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(self.weight_map.items()))}
            _replace(self.out / SAFE_INDEX, lambda tmp: tmp.write_text(json.dumps(index, indent=2) + "\n"))
        if generation_config:
            _replace(self.out / GENERATION_CONFIG,
                     lambda tmp: tmp.write_text(json.dumps(generation_config, indent=2, sort_keys=True) + "\n"))
        _replace(self.out / CONFIG, lambda tmp: tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n"))
        return self.out


# -- from a running engine -----------------------------------------------------------------------

def _whole_shape(t: torch.Tensor, strategy) -> tuple[int, ...]:
    from trident.checkpointing.files import global_shape
    shape = list(global_shape(t, strategy))
    spec = getattr(t, "tp_spec", None) if getattr(t, "tensor_model_parallel", False) else None
    if spec is not None:
        shape[spec.dim] = spec.full_size
    return tuple(shape)


def _export_names(hf: nn.Module, state: dict[str, torch.Tensor]) -> list[str]:
    """State-dict names to write: each tensor once (tied aliases left out), minus the model's
    `_keys_to_ignore_on_save`."""
    ignore = set(getattr(hf, "_keys_to_ignore_on_save", None) or ())
    seen, names = set(), []
    for name, t in state.items():
        if id(t) in seen or name in ignore:
            continue
        seen.add(id(t))
        names.append(name)
    return names


@torch.no_grad()
def save_pretrained(engine, save_dir: str | Path, *, max_shard_size: int | str = DEFAULT_MAX_SHARD,
                    dtype: torch.dtype | None = None) -> Path:
    """Write the engine's transformers model as `from_pretrained` reads it (see the module
    docstring). Collective: every rank of the engine calls it; mesh rank 0 writes."""
    from trident.comm import collectives
    from trident.engine.full_state import whole_tensors

    mesh = engine.mesh
    if mesh.pp_size > 1:
        return _save_pretrained_pipeline(engine, save_dir, max_shard_size=max_shard_size, dtype=dtype)
    found = export_root(engine.module)
    if found is None:
        raise ValueError(f"save_pretrained: {type(engine.module).__name__} holds no transformers PreTrainedModel; "
                         "use save_checkpoint or save_16bit_model for other models")
    _, hf = found
    state = hf.state_dict(keep_vars=True)
    names = _export_names(hf, state)

    def out_dtype(t: torch.Tensor) -> torch.dtype:
        return dtype if (dtype is not None and t.is_floating_point()) else t.dtype

    sizes = [(n, _numel(_whole_shape(state[n], engine.strategy)) * torch.empty(0, dtype=out_dtype(state[n])).element_size())
             for n in names]
    groups = plan_files(sizes, parse_size(max_shard_size))
    writer = FolderWriter(save_dir, groups) if engine.ranks.writer else None
    error: list = [None]  # the writer's first failure; it keeps taking part in the gathers
    float_dtypes = {state[n].dtype for n in names if state[n].is_floating_point()}
    for i, group in enumerate(groups):
        whole = whole_tensors(hf, group, mesh, dtype=dtype)
        if writer is not None and error[0] is None:
            try:
                writer.write(i, whole)
            except Exception as err:
                error = [f"{type(err).__name__}: {err}"]
        del whole
    if writer is not None and error[0] is None:
        exported = dtype if dtype is not None else (next(iter(float_dtypes)) if len(float_dtypes) == 1 else None)
        try:
            writer.finish(config_dict(hf, exported), generation_config(hf))
        except Exception as err:
            error = [f"{type(err).__name__}: {err}"]
    if engine.ranks.group is not None:
        collectives.broadcast_object_list(error, src=0, group=engine.ranks.group)
    if error[0] is not None:
        raise RuntimeError(f"save_pretrained: the writing rank failed to write {save_dir}: {error[0]}")
    return Path(save_dir)


def _save_pretrained_pipeline(engine, save_dir, *, max_shard_size, dtype) -> Path:
    """Pipeline stages hold different layers under pipeline names: every stage writes its pieces
    as a checkpoint into `save_dir/.trident-export` (a folder all ranks can reach, as a
    checkpoint folder must be), mesh rank 0 exports it and removes it."""
    import shutil

    from trident.comm import collectives
    if export_record(engine.module) is None:
        raise ValueError("save_pretrained: this pipeline was not built from a transformers model "
                         "(trident.pipeline.from_hf), so its layers have no transformers names")
    tmp = Path(save_dir) / ".trident-export"
    folder = engine.save_checkpoint(str(tmp), tag="export", save_latest=False)
    error = [None]
    if engine.mesh.mesh_rank == 0:
        try:
            export_checkpoint(folder, save_dir, max_shard_size=max_shard_size, dtype=dtype)
        except Exception as err:  # every rank raises it, none waits for rank 0
            error = [f"{type(err).__name__}: {err}"]
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    collectives.broadcast_object_list(error, src=0, group=engine.mesh.mesh_group)
    if error[0] is not None:
        raise RuntimeError(f"save_pretrained: mesh rank 0 failed to write {save_dir}: {error[0]}")
    return Path(save_dir)


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# -- from a trident checkpoint on disk ------------------------------------------------------------

def export_checkpoint(checkpoint_dir: str | Path, out: str | Path, *, tag: str | None = None,
                      config: str | Path | dict | None = None, max_shard_size: int | str = DEFAULT_MAX_SHARD,
                      dtype: torch.dtype | str | None = None) -> Path:
    """Write a trident checkpoint (any layout) as a transformers folder; no process group.

    `config`: a transformers `config.json` (or the folder holding it, or a dict) for a
    checkpoint whose manifest does not record one (saved by an older trident, or a model built
    without transformers but named like one). `dtype`: of the floating tensors (default: the
    model's dtype recorded in the manifest; the values are the fp32 master weights)."""
    from trident.checkpointing.consolidate import checkpoint_folder
    from trident.checkpointing.reshard import CheckpointReader
    from trident.checkpointing.state import CheckpointError

    reader = CheckpointReader(checkpoint_folder(checkpoint_dir, tag))
    record = reader.manifest.get("hf") or {}
    hf_config = _read_config(config) if config is not None else record.get("config")
    if hf_config is None:
        raise CheckpointError(f"{reader.folder}: the manifest records no transformers config (the model held no "
                              "transformers PreTrainedModel when it was saved, or an older trident saved it); pass "
                              "the model's config.json with --config")
    prefix = record.get("prefix", "")
    name_map: dict[str, str] = record.get("names") or {}
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"dtype {dtype!r} is not a torch dtype; use e.g. float32, bfloat16, float16")
        dtype = getattr(torch, dtype)
    plan: list[tuple[str, str]] = []  # (checkpoint name, transformers name)
    for name in reader.tensors:
        if name in reader.tied:
            continue
        if name_map:
            hf_name = name_map.get(name)
        else:
            hf_name = name[len(prefix):] if name.startswith(prefix) else None
        if hf_name is not None and hf_name not in {h for _, h in plan}:
            plan.append((name, hf_name))
    if not plan:
        raise CheckpointError(f"{reader.folder}: no tensor of the checkpoint lies under the transformers model's "
                              f"prefix {prefix!r}; is it a checkpoint of a transformers model?")

    def out_dtype(name: str) -> torch.dtype:
        stored = getattr(torch, reader.entry(name)["dtype"])
        return dtype if (dtype is not None and stored.is_floating_point) else stored

    sizes = [(n, _numel(reader.entry(n)["global_shape"]) * torch.empty(0, dtype=out_dtype(n)).element_size())
             for n, _ in plan]
    groups = plan_files(sizes, parse_size(max_shard_size))
    hf_of = dict(plan)
    writer = FolderWriter(out, [[hf_of[n] for n in g] for g in groups])
    float_dtypes = set()
    for i, group in enumerate(groups):
        tensors = {}
        for n in group:
            t = reader.value(n).to(out_dtype(n))
            if t.is_floating_point():
                float_dtypes.add(t.dtype)
            tensors[hf_of[n]] = t
        writer.write(i, tensors)
    config_out = dict(hf_config)
    if len(float_dtypes) == 1:
        name = str(next(iter(float_dtypes))).replace("torch.", "")
        config_out["dtype"] = name
        if "torch_dtype" in config_out:
            config_out["torch_dtype"] = name
    return writer.finish(config_out, record.get("generation_config"))


def _read_config(config: str | Path | dict) -> dict:
    if isinstance(config, dict):
        return dict(config)
    path = Path(config)
    if path.is_dir():
        path = path / CONFIG
    if not path.is_file():
        from trident.checkpointing.state import CheckpointError
        raise CheckpointError(f"{path}: no such config file; pass a transformers config.json or its folder")
    return json.loads(path.read_text())
