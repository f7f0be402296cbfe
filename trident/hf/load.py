"""`from_pretrained`: a local safetensors checkpoint read straight into each rank's share.

The model is built from its `config.json` with its parameters on the meta device (buffers
such as RoPE's `inv_freq` are computed as usual): nothing of the size of the model is
allocated. The trident config says what each rank keeps:

- `tensor_parallel` (size > 1 or a plan): the plan is applied to the meta model (trident's
  tp layers, tied embeddings kept tied, head counts localised), so every parameter knows its
  `ShardSpec`; each rank reads the rows / columns of its slice (the blocks of a fused q|k|v,
  GPT-2's transposed `Conv1D` along its own dim), the vocabulary padding filled with zeros.
- pipeline stages > 1: whole tensors; `trident.initialize` splits the model into stages
  (`trident.pipeline.from_hf`) and each stage by its tensor-parallel plan.
- `zero_optimization.stage` 3: each (tp-local) parameter is cut into the flat data-parallel
  shards `trident.zero.Init` makes; a rank reads the rows of the checkpoint tensor that cover
  its shard (at most a partial row more on each side) and keeps only the shard.

Reads go through `safetensors.safe_open(...).get_slice(...)`, so only the requested bytes are
copied out of the file; `model.trident_load_report` records the bytes read and held. The
result is what `trident.initialize(model=..., config=<the same config>, mesh=<the same mesh>)`
takes: stage-3 shards as `zero.Init` leaves them, tp layers built for the mesh.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trident.models.transformers.meta import meta_parameters

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"


class LoadError(RuntimeError):
    """A checkpoint folder cannot be loaded; the message names the file or tensor."""


def from_pretrained(name_or_path: str | Path, *, mesh=None, config: Any = None, dtype: torch.dtype | str | None = None,
                    model_class: Any = None, hf_config: Any = None, attn_implementation: str | None = None,
                    **config_overrides: Any) -> nn.Module:
    """The transformers model of a local checkpoint folder, holding only this rank's share.

    `config`: trident's config (path, dict or parsed) for the ZeRO stage and the tensor-parallel
    size and plan; None loads whole tensors. `mesh`: the ParallelMesh `trident.initialize` will
    use (built from `config` when None and the layout needs process groups). `dtype`: floating
    tensors' dtype (default torch's default dtype; "auto": as stored). `model_class`: default
    `AutoModelForCausalLM`; `hf_config`: a transformers config to use instead of the folder's.
    """
    import transformers

    folder = Path(name_or_path)
    if not folder.is_dir():
        raise LoadError(f"{folder}: not a local folder. trident.hf.from_pretrained reads a checkpoint on disk "
                        "(config.json and model.safetensors, or shards with model.safetensors.index.json); "
                        "download it first, e.g. with huggingface_hub.snapshot_download")
    weight_map = checkpoint_files(folder)
    if hf_config is None:
        hf_config = transformers.AutoConfig.from_pretrained(str(folder), **config_overrides)
    if attn_implementation is not None:
        hf_config._attn_implementation = attn_implementation
    stage, tp_size, plan = _layout(config)
    mesh = _mesh_for(mesh, config, stage, tp_size)
    if mesh is not None and tp_size > 1 and mesh.tp_size != tp_size:
        raise ValueError(f"from_pretrained: tensor_parallel.size={tp_size} but the mesh has tp={mesh.tp_size}; pass "
                         "the mesh built from the same config")
    model_class = model_class or transformers.AutoModelForCausalLM
    with meta_parameters():
        if hasattr(model_class, "from_config"):
            model = model_class.from_config(hf_config)
        else:
            model = model_class(hf_config)
    if plan is not None or tp_size > 1:
        from trident.tensor_parallel.plan import apply_plan
        apply_plan(model, plan if plan is not None else "auto", mesh)
        model._trident_tp_loaded = True  # trident.initialize checks the layers instead of applying the plan again
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    dp_group = mesh.dp_group if (stage == 3 and mesh is not None) else None
    with _Reader(folder, weight_map) as reader:
        _materialize(model, reader, dtype, dp_group, mesh.tp_rank if mesh is not None else 0)
        model.trident_load_report = reader.report(model)
    model.eval()
    return model


# -- the checkpoint's files ------------------------------------------------------------------

def checkpoint_files(folder: Path) -> dict[str, str]:
    """Tensor name -> file name, from the index of a sharded checkpoint or the single file.
    Raises LoadError naming a missing file."""
    index = folder / SAFE_INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise LoadError(f"{index}: not a readable safetensors index ({err!r}); it should hold "
                            "{\"weight_map\": {tensor name: file name}}") from None
        missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
        if missing:
            more = f" (and {len(missing) - 1} more: {', '.join(missing[1:4])})" if len(missing) > 1 else ""
            raise LoadError(f"{folder / missing[0]}: missing shard file{more}, listed in {index}; the checkpoint is "
                            "incomplete: download or copy that file")
        return dict(weight_map)
    single = folder / SAFE_WEIGHTS
    if single.is_file():
        from safetensors import safe_open
        with safe_open(str(single), "pt") as f:
            return {k: SAFE_WEIGHTS for k in f.keys()}
    others = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors"))
    raise LoadError(f"{folder}: neither {SAFE_WEIGHTS} nor {SAFE_INDEX} is here"
                    + (f" (found {', '.join(others[:4])}; only safetensors checkpoints are read)" if others else "")
                    + "; save the model with save_pretrained(safe_serialization=True)")


class _Reader:
    """Open safetensors files and count the bytes of every slice asked for."""

    def __init__(self, folder: Path, weight_map: dict[str, str]) -> None:
        self.folder, self.weight_map = folder, weight_map
        self.stack = contextlib.ExitStack()
        self.handles: dict[str, Any] = {}
        self.bytes_read = 0
        self.files_opened: set[str] = set()

    def __enter__(self) -> "_Reader":
        return self

    def __exit__(self, *exc) -> None:
        self.stack.close()

    def slice(self, key: str):
        file = self.weight_map[key]
        if file not in self.handles:
            from safetensors import safe_open
            path = self.folder / file
            try:
                self.handles[file] = self.stack.enter_context(safe_open(str(path), "pt"))
            except Exception as err:  # safetensors raises its own types for a bad header
                raise LoadError(f"{path}: not a readable safetensors file ({err}); the checkpoint is damaged") from None
            self.files_opened.add(file)
        try:
            return self.handles[file].get_slice(key)
        except Exception as err:
            raise LoadError(f"{self.folder / file}: has no tensor {key!r} although {SAFE_INDEX} lists it there "
                            f"({err}); the checkpoint is inconsistent") from None

    def read(self, sl, index) -> torch.Tensor:
        """A copy of `sl[index]` in memory of its own: safetensors returns a view into the whole
        tensor's memory map, of which only the pages under the slice are read; keeping the view
        would keep the mapping (and writes to the parameter would go to a private copy of it)."""
        view = sl[index]
        t = torch.empty(view.shape, dtype=view.dtype).copy_(view)
        self.bytes_read += t.numel() * t.element_size()
        return t

    def report(self, model: nn.Module) -> dict[str, int]:
        held = 0
        seen: set[int] = set()
        for p in list(model.parameters()):
            if id(p) in seen:
                continue
            seen.add(id(p))
            shard = getattr(p, "_trident_shard", None)
            t = shard if shard is not None else p.data
            held += t.numel() * t.element_size()
        return {"bytes_read": self.bytes_read, "parameter_bytes_held": held, "files_opened": len(self.files_opened)}


# -- the layout -------------------------------------------------------------------------------

def _layout(config) -> tuple[int, int, Any]:
    """(ZeRO stage, tp size, tp plan) of a trident config (None: whole tensors)."""
    if config is None:
        return 0, 1, None
    from trident.config import load_config
    from trident.config.errors import ConfigError
    try:
        cfg = load_config(config)
    except ConfigError:  # e.g. "auto" values a Trainer fills in later: only the layout matters here
        from trident.config.loader import read_json
        data = config if isinstance(config, dict) else read_json(config)
        zero, tp = data.get("zero_optimization") or {}, data.get("tensor_parallel") or {}
        stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
        size = tp.get("size", 1) if isinstance(tp, dict) else 1
        pipe = data.get("pipeline") or {}
        if isinstance(pipe, dict) and isinstance(pipe.get("stages"), int) and pipe["stages"] > 1:
            return 0, 1, None
        return (stage if isinstance(stage, int) else 0), (size if isinstance(size, int) else 1), \
            (tp.get("plan") if isinstance(tp, dict) else None)
    if cfg.pipeline.stages > 1:  # trident.initialize splits the whole model into stages (and each by tp)
        return 0, 1, None
    return cfg.zero_optimization.stage, cfg.tensor_parallel.size, cfg.tensor_parallel.plan


def _mesh_for(mesh, config, stage: int, tp_size: int):
    if mesh is not None or (stage != 3 and tp_size == 1):
        return mesh
    import torch.distributed as dist
    from trident.comm.backend import init_distributed
    from trident.config import load_config
    from trident.parallel.mesh import ParallelMesh
    cfg = load_config(config)
    if not dist.is_initialized():
        init_distributed(timeout_s=cfg.distributed.timeout_s)
    return ParallelMesh.build(pp=cfg.pipeline.stages, tp=cfg.tensor_parallel.size, cp=cfg.context_parallel.size,
                              ep=cfg.expert_parallel.size)


# -- reading each rank's share ------------------------------------------------------------------

def _materialize(model: nn.Module, reader: _Reader, dtype, dp_group, tp_rank: int) -> None:
    """Replace every meta parameter by this rank's share read from the checkpoint; load the
    persistent buffers the checkpoint has."""
    owners: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((module, pname, f"{mname}.{pname}" if mname else pname))
    for places in owners.values():
        old = places[0][0]._parameters[places[0][1]]
        names = [n for _, _, n in places]
        key = next((n for n in names if n in reader.weight_map), None)
        if key is None:
            raise LoadError(f"{reader.folder}: the checkpoint has no tensor {names[0]!r}"
                            + (f" (nor its tied names {names[1:]})" if len(names) > 1 else "")
                            + f", which {type(model).__name__} needs; it holds {len(reader.weight_map)} tensors, e.g. "
                            f"{', '.join(list(reader.weight_map)[:3])}. Is it a checkpoint of this model?")
        new = _load_param(old, key, reader, dtype, dp_group, tp_rank)
        for module, pname, _ in places:
            module._parameters[pname] = new
    for mname, module in model.named_modules():
        for bname, buf in module._buffers.items():
            if buf is None or bname in module._non_persistent_buffers_set:
                continue
            key = f"{mname}.{bname}" if mname else bname
            if key in reader.weight_map:
                sl = reader.slice(key)
                value = reader.read(sl, slice(None)) if sl.get_shape() else reader.read(sl, ())
                module._buffers[bname] = value.to(buf.dtype).reshape(buf.shape)


def _target_dtype(stored: torch.dtype, dtype) -> torch.dtype:
    if not stored.is_floating_point or dtype == "auto":
        return stored
    return dtype if dtype is not None else torch.get_default_dtype()


def _load_param(old: nn.Parameter, key: str, reader: _Reader, dtype, dp_group, tp_rank: int) -> nn.Parameter:
    sl = reader.slice(key)
    stored_shape = tuple(sl.get_shape())
    spec = getattr(old, "tp_spec", None) if getattr(old, "tensor_model_parallel", False) else None
    local_shape = tuple(old.shape)
    full_shape = list(local_shape)
    if spec is not None:
        full_shape[spec.dim] = spec.full_size
    if stored_shape != tuple(full_shape):
        raise LoadError(f"{reader.folder / reader.weight_map[key]}: tensor {key!r} has shape {stored_shape}, the model "
                        f"built from config.json needs {tuple(full_shape)}; the checkpoint is of another model")
    probe = reader.read(sl, tuple(slice(0, 0) for _ in stored_shape)) if stored_shape else None
    stored_dtype = probe.dtype if probe is not None else reader.read(sl, ()).dtype
    out_dtype = _target_dtype(stored_dtype, dtype)
    n = math.prod(local_shape)
    if dp_group is None:
        data = _local_rows(reader, sl, stored_shape, spec, tp_rank, 0, local_shape[0] if local_shape else 0)
        new = nn.Parameter(data.to(out_dtype).reshape(local_shape).contiguous(), requires_grad=old.requires_grad)
    else:
        import torch.distributed as dist
        from trident.zero.partition import padded_size
        world, rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        size = padded_size(max(n, 1), world) // world
        lo, hi = min(rank * size, n), min((rank + 1) * size, n)
        shard = torch.zeros(size, dtype=out_dtype)
        if hi > lo:
            if not local_shape:
                flat = reader.read(sl, ()).reshape(-1)
                shard[:hi - lo] = flat[lo:hi]
            else:
                row = n // local_shape[0]
                r0, r1 = lo // row, -(-hi // row)
                rows = _local_rows(reader, sl, stored_shape, spec, tp_rank, r0, r1).reshape(-1)
                shard[:hi - lo] = rows[lo - r0 * row:hi - r0 * row].to(out_dtype)
        new = nn.Parameter(torch.empty(0, dtype=out_dtype), requires_grad=old.requires_grad)
        new._trident_shard = shard
        new._trident_shape = local_shape
        new._trident_group = dp_group
    for attr, value in old.__dict__.items():
        if not attr.startswith("_trident_"):
            setattr(new, attr, value)
    return new


def _segments(spec, rank: int, k0: int, k1: int) -> list[tuple[int, int] | int]:
    """The local indices [k0, k1) along the split dim as pieces of the full tensor: (start, end)
    ranges to read, or an int count of zero (vocabulary padding) entries."""
    out: list[tuple[int, int] | int] = []
    if spec.stride == 1:
        start = rank * spec.local_size
        a, b = start + k0, start + k1
        real_end = min(b, spec.full_size)
        if real_end > a:
            out.append((a, real_end))
        if b > max(a, spec.full_size):
            out.append(b - max(a, spec.full_size))
        return out
    block = spec.full_size // spec.stride
    per_block = block // spec.tp_size
    k = k0
    while k < k1:
        j, o = divmod(k, per_block)
        take = min(per_block - o, k1 - k)
        a = j * block + rank * per_block + o
        out.append((a, a + take))
        k += take
    return out


def _local_rows(reader: _Reader, sl, full_shape: tuple, spec, rank: int, r0: int, r1: int) -> torch.Tensor:
    """Rows [r0, r1) (along dim 0) of this tp rank's local tensor, read from the full one."""
    if not full_shape:
        return reader.read(sl, ())
    if spec is None or spec.tp_size == 1:
        return reader.read(sl, slice(r0, r1))
    d = spec.dim
    pieces = []
    if d == 0:
        for seg in _segments(spec, rank, r0, r1):
            if isinstance(seg, int):
                pieces.append(torch.zeros((seg,) + tuple(full_shape[1:]), dtype=_probe_dtype(reader, sl)))
            else:
                pieces.append(reader.read(sl, slice(*seg)))
        return torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]
    lead = (slice(r0, r1),) + (slice(None),) * (d - 1)
    for seg in _segments(spec, rank, 0, spec.local_size):
        if isinstance(seg, int):
            shape = list(full_shape)
            shape[0], shape[d] = r1 - r0, seg
            pieces.append(torch.zeros(shape, dtype=_probe_dtype(reader, sl)))
        else:
            pieces.append(reader.read(sl, lead + (slice(*seg),)))
    return torch.cat(pieces, dim=d) if len(pieces) > 1 else pieces[0]


def _probe_dtype(reader: _Reader, sl) -> torch.dtype:
    return sl[tuple(slice(0, 0) for _ in sl.get_shape())].dtype
