"""DeepSpeed checkpoints read without DeepSpeed, and written as trident checkpoints.

A DeepSpeed checkpoint folder (`save_dir/<tag>/`, with `latest` naming the tag) holds, by
layout (DeepSpeed 0.19's file names; `mp` is the tensor- or pipeline-parallel rank):

  ZeRO 0-2   mp_rank_00_model_states.pt: the module's state dict, the shapes of the trainable
             parameters per optimizer group (`param_shapes`), counters, lr scheduler, client
             state. Stage 0 keeps the optimizer's state dict there; stages 1-2 add one
             zero_pp_rank_<d>_mp_rank_00_optim_states.pt per data-parallel rank, whose flat fp32
             partition of each group (`single_partition_of_fp32_groups`) and Adam moments
             concatenate, over the ranks, into the group's parameters in `param_shapes` order.
  ZeRO 3     zero_pp_rank_<d>_mp_rank_00_model_states.pt (buffers, counters) and
             zero_pp_rank_<d>_mp_rank_00_optim_states.pt per rank, whose `fp32_flat_groups` hold
             every parameter's own partition, ceil(numel / ranks) elements each.
  pipeline   layer_<i>-model_states.pt per layer (its state dict) and mp_rank_<s>_model_states.pt
             per stage (that stage's optimizer state dict and the counters).

The pickles name a few DeepSpeed classes (its loss scaler, the ZeRO stage enum, fragment
addresses). They are read with torch's weights-only unpickler, each such class replaced by a
plain record (`_Record`), so DeepSpeed is never imported and no code from the file runs.

`read_deepspeed` gives a `DeepSpeedState`: every parameter's whole fp32 master and optimizer
state by name, buffers, counters. `import_deepspeed` writes it as a trident checkpoint in
stage-0 form (one model file, one optimizer file keyed by name, as `trident checkpoint reshard`
writes), which then loads under any trident layout. Everything is read and checked before
anything is written; the output appears atomically. Importing this module registers it with
the engine (`register_checkpoint_importer`), so `engine.load_checkpoint` reads DeepSpeed folders.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_bytes

from trident.checkpointing.files import (CLIENT_FILE, FORMAT_VERSION, LATEST, MANIFEST, MODEL_FILE, STATE_FILE,
                                        CheckpointError, write_hashed)
from trident.deepspeed.engine.api import register_checkpoint_importer

# DeepSpeed's own entries in a model_states file; every other top-level key is the client state.
DEEPSPEED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "checkpoint_parallel_dimensions", "ds_universal_checkpoint_info", "universal_checkpoint_info", "iteration",
    "compiled_autograd",
})
SUPPORTED_VERSIONS = ((0, 10), (0, 19))
"""DeepSpeed versions (major, minor) whose layouts this reader knows, inclusive."""

_LAYER = re.compile(r"^layer_(\d+)-model_states\.pt$")


class _Record:
    """Stands in for a pickled DeepSpeed object: keeps its constructor arguments and state."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.__dict__.update(kwargs)

    def __setstate__(self, state: Any) -> None:
        self.__dict__.update(state if isinstance(state, dict) else {"state": state})

    def value(self) -> Any:
        """An enum's value (pickled as a call with the value as its one argument)."""
        return self.args[0] if self.args else self.__dict__.get("_value_")


@dataclass
class DeepSpeedState:
    """A DeepSpeed checkpoint as whole tensors, keyed by the model's state-dict names."""

    folder: Path
    tag: str
    version: str
    layout: dict
    params: dict[str, torch.Tensor]                  # trainable parameters: whole fp32 masters
    optimizer_state: dict[str, dict[str, Any]]       # per parameter: exp_avg, exp_avg_sq, step, ...
    param_groups: list[dict]
    group_of: dict[str, int]
    other: dict[str, torch.Tensor] = field(default_factory=dict)   # buffers and frozen parameters
    counters: dict[str, Any] = field(default_factory=dict)
    lr_scheduler: Any = None
    client_state: dict = field(default_factory=dict)

    def fp32_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        state = dict(self.params)
        for name, t in self.other.items():
            if not (exclude_frozen_parameters and name in self.layout.get("frozen", ())):
                state[name] = t.float() if t.is_floating_point() else t
        return state


# -- locating the files -----------------------------------------------------------------------------

def _tag_folder(ds_dir: str | Path, tag: str | None) -> tuple[Path, str]:
    root = Path(ds_dir)
    if tag is None and _holds_states(root):
        return root, root.name
    if tag is None:
        latest = root / LATEST
        if not latest.exists():
            raise CheckpointError(f"{root}: no DeepSpeed checkpoint here (no '{LATEST}' file and no "
                                  "*model_states.pt); pass save_checkpoint's folder or one of its tag folders")
        tag = latest.read_text().strip()
    folder = root / tag
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: missing; '{LATEST}' (or --tag) names tag {tag!r} but there is no such folder")
    return folder, tag


def _holds_states(folder: Path) -> bool:
    return folder.is_dir() and any(p.name.endswith("model_states.pt") for p in folder.iterdir())


def is_deepspeed_checkpoint(ds_dir: str | Path, tag: str | None = None) -> bool:
    """True when `ds_dir` (or its tag folder) holds DeepSpeed's files and no trident manifest."""
    root = Path(ds_dir)
    try:
        folder, _ = _tag_folder(root, tag)
    except CheckpointError:
        return False
    return not (folder / MANIFEST).exists() and _holds_states(folder)


# -- reading pickles without DeepSpeed ---------------------------------------------------------------

def _load(path: Path) -> dict:
    """torch.load with the weights-only unpickler; DeepSpeed's classes become `_Record`s."""
    if not path.exists():
        raise CheckpointError(f"{path}: missing; the DeepSpeed checkpoint is incomplete (a rank's shard was not "
                              "written or was removed), so it cannot be imported")
    try:
        foreign = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception as err:  # noqa: BLE001 - any failure to read the archive means a damaged file
        raise CheckpointError(f"{path}: not a readable torch checkpoint ({type(err).__name__}: {err}); the file is "
                              "truncated or damaged") from None
    unknown = [g for g in foreign if not g.startswith("deepspeed.")]
    if unknown:
        raise CheckpointError(f"{path}: pickles objects trident will not load without running their code "
                              f"({', '.join(unknown)}); it is not a checkpoint layout this reader knows")
    try:
        with torch.serialization.safe_globals([(_Record, name) for name in foreign]):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001
        raise CheckpointError(f"{path}: cannot be unpickled ({type(err).__name__}: {str(err)[:200]}); the file is "
                              "truncated or damaged") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: holds a {type(obj).__name__}, not the dict DeepSpeed writes")
    return obj


def _check_version(path: Path, states: dict) -> str:
    version = str(states.get("ds_version", ""))
    match = re.match(r"^(\d+)\.(\d+)", version)
    if match is None:
        raise CheckpointError(f"{path}: no ds_version; not a checkpoint written by DeepSpeed's save_checkpoint")
    key = (int(match.group(1)), int(match.group(2)))
    low, high = SUPPORTED_VERSIONS
    if not low <= key <= high:
        raise CheckpointError(f"{path}: written by DeepSpeed {version}, whose checkpoint layout this reader does not "
                              f"know (it reads DeepSpeed {low[0]}.{low[1]} to {high[0]}.{high[1]}); convert it with "
                              "that DeepSpeed's zero_to_fp32.py, or save it again with a supported version")
    return version


def _need(obj: dict, key: str, path: Path, version: str) -> Any:
    if key not in obj:
        raise CheckpointError(f"{path}: has no '{key}' entry, which DeepSpeed {version}'s layout has; the file is "
                              "from an unknown DeepSpeed layout or damaged")
    return obj[key]


# -- the layouts ---------------------------------------------------------------------------------

def read_deepspeed(ds_dir: str | Path, tag: str | None = None) -> DeepSpeedState:
    """Read a DeepSpeed ZeRO 0-3 or pipeline checkpoint as whole fp32 tensors by name."""
    folder, tag = _tag_folder(ds_dir, tag)
    names = {p.name for p in folder.iterdir()}
    if (folder / "zero").is_dir() or (folder / "universal_checkpoint_info.pt").exists():
        raise CheckpointError(f"{folder}: a DeepSpeed universal checkpoint (per-parameter folders under zero/); "
                              "importing those is not supported: import the checkpoint DeepSpeed saved before "
                              "converting it (ds_to_universal)")
    if any(n.startswith("mp_rank_") and n != "mp_rank_00_model_states.pt" for n in names) and \
            not any(_LAYER.match(n) for n in names):
        raise CheckpointError(f"{folder}: a tensor-parallel DeepSpeed checkpoint (several mp_rank_* files): "
                              "importing Megatron-style tensor-parallel shards is not supported")
    if any(_LAYER.match(n) for n in names):
        return _read_pipeline(folder, tag, names)
    zero3 = sorted(n for n in names if re.match(r"^zero_pp_rank_\d+_mp_rank_00_model_states\.pt$", n))
    if zero3:
        return _read_zero3(folder, tag, len(zero3))
    return _read_zero012(folder, tag, names)


def _common(folder: Path, tag: str, states: dict, version: str, layout: dict, params, opt, groups, group_of,
            other) -> DeepSpeedState:
    client = {k: v for k, v in states.items() if k not in DEEPSPEED_KEYS}
    config = states.get("ds_config") or {}
    counters = {k: int(states.get(k) or 0) for k in ("global_steps", "global_samples", "skipped_steps")}
    counters["gradient_accumulation_steps"] = int(config.get("gradient_accumulation_steps") or 1) \
        if isinstance(config.get("gradient_accumulation_steps"), int) else 1
    return DeepSpeedState(folder, tag, version, layout, params, opt, groups, group_of, other, counters,
                          states.get("lr_scheduler"), client)


def _optim_file(folder: Path, dp_rank: int) -> Path:
    """Data-parallel rank `dp_rank`'s optimizer file (DeepSpeed prefixes it with `bf16_` in bf16 runs)."""
    plain = folder / f"zero_pp_rank_{dp_rank}_mp_rank_00_optim_states.pt"
    prefixed = folder / f"bf16_{plain.name}"
    return prefixed if prefixed.exists() and not plain.exists() else plain


def _stage_of(osd: dict, path: Path) -> int:
    """The ZeRO stage an optimizer file records; DeepSpeed's bf16 optimizer (ZeRO-1 layout, no
    `zero_stage` entry) counts as stage 1."""
    stage = osd.get("zero_stage")
    if stage is None and "single_partition_of_fp32_groups" in osd:
        return 1
    value = stage.value() if isinstance(stage, _Record) else stage
    if not isinstance(value, int):
        raise CheckpointError(f"{path}: no zero_stage entry; an optimizer layout this reader does not know")
    return value


def _module_other(states: dict, trainable: set[str]) -> dict[str, torch.Tensor]:
    module = states.get("module") or {}
    return {k: v for k, v in module.items() if k not in trainable and isinstance(v, torch.Tensor) and v.numel()}


def _read_zero012(folder: Path, tag: str, names: set[str]) -> DeepSpeedState:
    path = folder / "mp_rank_00_model_states.pt"
    states = _load(path)
    version = _check_version(path, states)
    module = _need(states, "module", path, version)
    dp = int(states.get("dp_world_size") or 1)
    optim_files = [_optim_file(folder, d) for d in range(dp)]
    if not any(f.name in names for f in optim_files):  # ZeRO stage 0: a plain optimizer state dict
        return _read_stage0(folder, tag, states, version, path)
    shapes = _need(states, "param_shapes", path, version)
    parts = [_need(_load(f), "optimizer_state_dict", f, version) for f in optim_files]
    stage = _stage_of(parts[0], optim_files[0])
    if stage not in (1, 2):
        raise CheckpointError(f"{optim_files[0]}: zero_stage {stage} in a ZeRO 1-2 layout; the checkpoint is "
                              "inconsistent or from an unknown DeepSpeed layout")
    params, opt, group_of = {}, {}, {}
    groups = _need(parts[0], "base_optimizer_state", optim_files[0], version)["param_groups"]
    for g, group_shapes in enumerate(shapes):
        flats = [_need(p, "single_partition_of_fp32_groups", f, version)[g] for p, f in zip(parts, optim_files)]
        for p, f in zip(parts, optim_files):
            if any(any(int(x) for x in pads) for pads in (p.get("param_alignment_paddings") or [])):
                raise CheckpointError(f"{f}: per-parameter alignment padding, a layout this reader does not know")
        states_g = [p["base_optimizer_state"]["state"].get(g, {}) for p in parts]
        full = torch.cat(flats)
        moments = {k: torch.cat([s[k] for s in states_g]) for k, v in states_g[0].items()
                   if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == flats[0].numel()}
        scalars = {k: v for k, v in states_g[0].items() if k not in moments}
        total = sum(_numel(s) for s in group_shapes.values())
        if full.numel() < total:
            raise CheckpointError(f"{folder}: the {dp} fp32 partitions of group {g} hold {full.numel()} elements but "
                                  f"its parameters need {total}; a shard is missing or from another run")
        offset = 0
        for name, shape in group_shapes.items():
            n = _numel(shape)
            params[name] = full[offset:offset + n].view(tuple(shape)).clone()
            opt[name] = {**{k: _copy(v) for k, v in scalars.items()},
                         **{k: m[offset:offset + n].view(tuple(shape)).clone() for k, m in moments.items()}}
            group_of[name] = g
            offset += n
    layout = {"kind": f"zero{stage}", "dp": dp, "pp": 1, "tp": 1}
    return _common(folder, tag, states, version, layout, params, opt, groups, group_of,
                   _module_other(states, set(params)) | _frozen(module, states, params))


def _frozen(module: dict, states: dict, params: dict) -> dict[str, torch.Tensor]:
    return {k: module[k] for k in (states.get("frozen_param_shapes") or {}) if k in module and k not in params}


def _read_stage0(folder: Path, tag: str, states: dict, version: str, path: Path) -> DeepSpeedState:
    module = states["module"]
    sd = states.get("optimizer")
    buffers = set(states.get("buffer_names") or [])
    shared = set((states.get("shared_params") or {}).keys())
    shapes = states.get("param_shapes")
    if shapes:
        candidates = [n for group in shapes for n in group]
    else:
        candidates = [n for n in module if n not in buffers and n not in shared]
    if isinstance(sd, dict) and "optimizer_state_dict" in sd:
        raise CheckpointError(f"{path}: saved by DeepSpeed's fp16/bf16 optimizer without ZeRO; importing that "
                              "layout is not supported (ZeRO stages 1-3 in any precision, and fp32 stage 0, are)")
    if not isinstance(sd, dict) or "state" not in sd:
        raise CheckpointError(f"{path}: no optimizer state (saved without it, or ZeRO shards are missing); "
                              "importing needs the optimizer state")
    indices = [i for group in sd["param_groups"] for i in group["params"]]
    if len(indices) != len(candidates):
        raise CheckpointError(f"{path}: the optimizer holds {len(indices)} parameters but the module has "
                              f"{len(candidates)} candidates; cannot tell which state belongs to which parameter")
    params, opt, group_of = {}, {}, {}
    by_index = dict(zip(indices, candidates))
    for g, group in enumerate(sd["param_groups"]):
        for i in group["params"]:
            name = by_index[i]
            params[name] = module[name].float().clone()
            opt[name] = {k: _copy(v) for k, v in sd["state"].get(i, {}).items()}
            group_of[name] = g
    groups = [{k: v for k, v in group.items() if k != "params"} for group in sd["param_groups"]]
    layout = {"kind": "zero0", "dp": int(states.get("dp_world_size") or 1), "pp": 1, "tp": 1}
    return _common(folder, tag, states, version, layout, params, opt, groups, group_of,
                   {k: v for k, v in module.items() if k not in params})


def _read_zero3(folder: Path, tag: str, dp: int) -> DeepSpeedState:
    model_files = [folder / f"zero_pp_rank_{d}_mp_rank_00_model_states.pt" for d in range(dp)]
    states = _load(model_files[0])
    version = _check_version(model_files[0], states)
    saved_dp = int(states.get("dp_world_size") or dp)
    if saved_dp != dp:
        missing = [f.name for f in (folder / f"zero_pp_rank_{d}_mp_rank_00_model_states.pt"
                                    for d in range(saved_dp)) if not f.exists()]
        raise CheckpointError(f"{folder}: written by {saved_dp} ranks but holds {dp} ZeRO-3 model files "
                              f"(missing: {', '.join(missing) or 'none'}); the checkpoint is incomplete")
    shapes = _need(states, "param_shapes", model_files[0], version)
    optim_files = [_optim_file(folder, d) for d in range(dp)]
    parts = [_need(_load(f), "optimizer_state_dict", f, version) for f in optim_files]
    if _stage_of(parts[0], optim_files[0]) != 3:
        raise CheckpointError(f"{optim_files[0]}: zero_stage {_stage_of(parts[0], optim_files[0])} in a ZeRO-3 "
                              "layout; the checkpoint is inconsistent")
    inner = [_need(p, "optimizer_state_dict", f, version) for p, f in zip(parts, optim_files)]
    groups = inner[0]["param_groups"]
    params, opt, group_of = {}, {}, {}
    for g, group_shapes in enumerate(shapes):
        flats = [_need(p, "fp32_flat_groups", f, version)[g] for p, f in zip(parts, optim_files)]
        states_g = [sd["state"].get(g, {}) for sd in inner]
        moment_keys = [k for k, v in states_g[0].items()
                       if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == flats[0].numel()]
        offset = 0
        for name, shape in group_shapes.items():
            n = _numel(shape)
            part = -(-n // dp)
            if offset + part > flats[0].numel():
                raise CheckpointError(f"{folder}: the fp32 partitions of group {g} end before parameter {name!r}; "
                                      "a shard is from another run or damaged")

            def whole(pieces: list[torch.Tensor]) -> torch.Tensor:
                return torch.cat([p[offset:offset + part] for p in pieces])[:n].view(tuple(shape)).clone()
            params[name] = whole(flats)
            opt[name] = {k: _copy(v) for k, v in states_g[0].items() if k not in moment_keys}
            opt[name].update({k: whole([s[k] for s in states_g]) for k in moment_keys})
            group_of[name] = g
            offset += part
    other = _module_other(states, set(params))
    layout = {"kind": "zero3", "dp": dp, "pp": 1, "tp": 1}
    return _common(folder, tag, states, version, layout, params, opt, groups, group_of, other)


def _read_pipeline(folder: Path, tag: str, names: set[str]) -> DeepSpeedState:
    layers = sorted((int(m.group(1)), folder / n) for n in names if (m := _LAYER.match(n)))
    stage_files = sorted(n for n in names if re.match(r"^mp_rank_\d+_model_states\.pt$", n))
    if not stage_files:
        raise CheckpointError(f"{folder}: layer files but no mp_rank_*_model_states.pt; the checkpoint is incomplete")
    stages = [_load(folder / n) for n in stage_files]
    version = _check_version(folder / stage_files[0], stages[0])
    pp = int((stages[0].get("checkpoint_parallel_dimensions") or {}).get("pp_degree") or len(stages))
    if len(stages) != pp:
        raise CheckpointError(f"{folder}: a {pp}-stage pipeline checkpoint with {len(stages)} stage file(s); the "
                              "checkpoint is incomplete")
    if any(n.startswith("zero_pp_rank_") for n in names):
        raise CheckpointError(f"{folder}: a pipeline checkpoint with ZeRO partitions; importing those is not "
                              "supported (pipeline checkpoints saved without ZeRO are)")
    layer_states = [(i, _load(path)) for i, path in layers]
    params, opt, group_of, other = {}, {}, {}, {}
    queue = [(i, [k for k, v in sd.items() if isinstance(v, torch.Tensor) and v.is_floating_point()], sd)
             for i, sd in layer_states]
    groups: list[dict] = []
    for s, states in enumerate(stages):
        sd = _need(states, "optimizer", folder / stage_files[s], version)
        indices = [i for group in sd["param_groups"] for i in group["params"]]
        mine: list[str] = []
        while len(mine) < len(indices) and queue:
            i, keys, layer = queue.pop(0)
            mine += [f"{i}.{k}" for k in keys]
            for k, v in layer.items():
                (params if k in keys else other)[f"{i}.{k}"] = v.float().clone() if k in keys else v
        if len(mine) != len(indices):
            raise CheckpointError(f"{folder / stage_files[s]}: stage {s}'s optimizer holds {len(indices)} parameters, "
                                  "which do not match its layers' files; the checkpoint is inconsistent")
        by_index = dict(zip(indices, mine))
        for g, group in enumerate(sd["param_groups"]):
            for i in group["params"]:
                opt[by_index[i]] = {k: _copy(v) for k, v in sd["state"].get(i, {}).items()}
                group_of[by_index[i]] = g
        groups = groups or [{k: v for k, v in group.items() if k != "params"} for group in sd["param_groups"]]
    for i, keys, layer in queue:  # parameterless layers after the last stage's parameters
        other.update({f"{i}.{k}": v for k, v in layer.items()})
    layout = {"kind": "pipeline", "dp": int(stages[0].get("dp_world_size") or 1), "pp": pp, "tp": 1}
    return _common(folder, tag, stages[0], version, layout, params, opt, groups, group_of, other)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _copy(v: Any) -> Any:
    return v.clone() if isinstance(v, torch.Tensor) else v


# -- writing the trident checkpoint ------------------------------------------------------------------

def import_deepspeed(ds_dir: str | Path, out: str | Path, tag: str | None = None) -> Path:
    """Convert the DeepSpeed checkpoint at `ds_dir` into a trident checkpoint under `out`
    (`out/<tag>/` and `out/latest`), loadable by `engine.load_checkpoint(out)` under any layout.
    Returns the checkpoint folder. `out` must not exist or be empty; on any error nothing is
    written."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out}: exists and is not an empty folder; choose a new folder for the imported "
                              "checkpoint")
    ds = read_deepspeed(ds_dir, tag)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    staging.chmod(0o755)
    try:
        _write(ds, staging / ds.tag)
        (staging / LATEST).write_text(ds.tag)
        if out.exists():
            out.rmdir()
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out / ds.tag


def _write(ds: DeepSpeedState, folder: Path) -> None:
    folder.mkdir(parents=True)
    model = {**{k: v.contiguous() for k, v in ds.other.items()}, **{k: v.contiguous() for k, v in ds.params.items()}}
    files = {MODEL_FILE: write_hashed(folder / MODEL_FILE, safetensors_bytes(model))}
    named = {name: {"group": ds.group_of[name], "master": ds.params[name], "state": ds.optimizer_state[name]}
             for name in ds.params}
    files["optim_pp0_tp0.pt"] = write_hashed(folder / "optim_pp0_tp0.pt", {
        "stage": 0, "format": "named", "params": named, "param_groups": ds.param_groups})
    c = ds.counters
    files[STATE_FILE] = write_hashed(folder / STATE_FILE, {
        "global_steps": c["global_steps"], "micro_steps": c["global_steps"] * c["gradient_accumulation_steps"],
        "global_samples": c["global_samples"], "skipped_steps": c["skipped_steps"],
        "lr_scheduler": ds.lr_scheduler, "loss_scaler": None})
    files[CLIENT_FILE] = write_hashed(folder / CLIENT_FILE, ds.client_state)
    tensors = {name: {"global_shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                      "shards": [{"file": MODEL_FILE, "pp": 0, "tp": 0, "slice": [[0, n] for n in t.shape]}]}
               for name, t in model.items()}
    manifest = {
        "format_version": FORMAT_VERSION, "tag": ds.tag, "global_steps": c["global_steps"],
        "layout": {"world_size": 1, "pp": 1, "dp": 1, "cp": 1, "tp": 1, "ep": 1, "zero_stage": 0},
        "imported_from": {"deepspeed_version": ds.version, "folder": str(ds.folder), **ds.layout},
        "resharded_from": {"deepspeed": ds.layout},  # loads by name under every layout (never the fast path)
        "tensors": tensors, "tied": {},
        "files": {f: {"sha256": digest, "bytes": (folder / f).stat().st_size} for f, digest in sorted(files.items())},
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))


register_checkpoint_importer(is_deepspeed_checkpoint, import_deepspeed)
