"""Checkpoints across layouts: any (pp, dp, tp, ZeRO stage) loads a checkpoint written under any other.

A checkpoint stores each tensor in pieces. Pipeline stages decide which file holds a name,
tensor parallelism slices it (the manifest's `tp_split`: dim, fused-block stride, vocab
padding), and ZeRO cuts the fp32 masters and the optimizer state into flat data-parallel
shards (each partition file carries its `ShardedLayout`). Resharding goes through one
layout-free view:

    CheckpointReader.param_state(name) -> ParamState(master, state, group)
        the whole fp32 master and every per-element optimizer state (exp_avg, ...) in the
        tensor's global shape, scalars (step) as saved, and its optimizer param group
    CheckpointReader.value(name) -> the whole tensor (the fp32 master of a parameter, else
        the saved buffer)

Loading under another layout (`prepare_resharded`) asks the running engine for the *shape* of
its own state (`engine.strategy.state_dict()`: its partition layouts and optimizer indices),
has the strategy fill it (`fill_resharded_state`) from the reader's whole tensors, sliced for
this rank's tp coordinate, and hands it back to the strategy's `load_state_dict`; the strategy never learns where the numbers came from.
Nothing here needs a process group, so the offline tool (`reshard`, `trident checkpoint
reshard`) uses the same reader.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save as safetensors_bytes

from trident.checkpointing.files import (CLIENT_FILE, FORMAT_VERSION, MANIFEST, STATE_FILE, CheckpointError,
                                        global_shape, is_partitioned, load_pickle, load_tensors, read_manifest, sha256_of,
                                        write_hashed)
from trident.tensor_parallel.split import ShardSpec
from trident.zero.partition import ShardedLayout
from trident.zero.state import chunk_indices

ZERO_PARTITIONS = "zero partitions"  # the "file" of a stage-3 parameter: it lives only in the partitions


@dataclass
class ParamState:
    """One parameter's fp32 master and optimizer state (per-element tensors shaped like the master)."""

    master: torch.Tensor
    group: int
    state: dict[str, Any] = field(default_factory=dict)

    def per_element(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state.items()
                if isinstance(v, torch.Tensor) and v.shape == self.master.shape and v.dim() > 0}


class CheckpointReader:
    """Reads a checkpoint folder as whole tensors, loading only the files a question needs."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        self.layout = self.manifest["layout"]
        self.tensors: dict[str, dict] = self.manifest["tensors"]
        self.tied: dict[str, str] = self.manifest.get("tied", {})
        self._files: dict[str, Any] = {}
        self._positions: dict[tuple[int, int, int], dict[str, ParamState]] = {}
        self._param_groups: list[dict] | None = None

    # -- files -------------------------------------------------------------------------------

    def _tensors_of(self, file: str) -> dict[str, torch.Tensor]:
        if file not in self._files:
            self._files[file] = load_tensors(self.folder, self.manifest, file)
        return self._files[file]

    def _pickle(self, file: str):
        if file not in self._files:
            self._files[file] = load_pickle(self.folder, self.manifest, file)
        return self._files[file]

    def entry(self, name: str) -> dict:
        entry = self.tensors.get(self.tied.get(name, name))
        if entry is None:
            raise CheckpointError(f"{self.folder}: the checkpoint has no tensor {name!r} (it holds "
                                  f"{len(self.tensors)} tensors, e.g. {', '.join(list(self.tensors)[:3])}); "
                                  "is it a checkpoint of this model?")
        return entry

    def spec(self, name: str, tp: int | None = None) -> ShardSpec | None:
        """How tensor parallelism splits `name` (at the checkpoint's tp, or at `tp`)."""
        entry = self.entry(name)
        split = entry.get("tp_split")
        if split is None:
            return None
        full = entry["global_shape"][split["dim"]]
        pad = split.get("padded_size", full) != full
        return ShardSpec(split["dim"], full, tp or self.layout["tp"], split["stride"], pad=pad)

    # -- optimizer state per (pp, tp) position -------------------------------------------------

    def _position(self, pp: int, tp: int, ep: int = 0) -> dict[str, ParamState]:
        """Every parameter's tp-local state at one (pp, ep, tp) position, from whatever files hold it
        (an ep position holds the dense parameters and its own experts)."""
        stage = self.layout["zero_stage"]
        key = (pp, tp, 0 if stage > 0 else ep)  # ZeRO: one position reads every ep rank's partitions
        if key not in self._positions:
            optim = f"optim_pp{pp}{_ep_part(ep, self.layout)}_tp{tp}.pt"
            if stage > 0:
                self._positions[key] = self._zero_position(pp, tp)
            elif optim in self.manifest["files"]:
                self._positions[key] = self._replicated_position(pp, tp, self._pickle(optim), ep)
            else:
                self._positions[key] = {}
        return self._positions[key]

    def _zero_position(self, pp: int, tp: int) -> dict[str, ParamState]:
        out: dict[str, ParamState] = {}
        dp = self.layout["dp"] * self.layout.get("cp", 1)  # ZeRO partitions over dp x cp (state.partition_index)
        ep = self.layout.get("ep", 1)  # dense groups partition over dp x cp x ep, experts (own groups) over dp x cp
        for e in range(ep):
            for d in range(dp):
                file = f"zero_pp{pp}{_ep_part(e, self.layout)}_tp{tp}_dp{d}.pt"
                part = self._pickle(file)
                if part.get("dp_world_size") != dp * ep or part.get("dp_rank") != d * ep + e:
                    raise CheckpointError(f"{self.folder / file}: holds dp rank {part.get('dp_rank')} of "
                                          f"{part.get('dp_world_size')}, expected {d * ep + e} of {dp * ep}; the "
                                          "checkpoint is inconsistent")
                self._param_groups = self._param_groups or part["optimizer"]["param_groups"]
                opt_state = part["optimizer"]["state"]
                for group, indices in zip(part["groups"], chunk_indices(part)):
                    rank = group.get("rank", part["dp_rank"])  # expert groups: the rank in their own group
                    _scatter_partition(out, group, [opt_state.get(i, {}) for i in indices], rank)
                del self._files[file]  # the pieces now live in `out`
        return out

    def _replicated_position(self, pp: int, tp: int, saved: dict, ep: int = 0) -> dict[str, ParamState]:
        if saved.get("format") == "named":  # written by `reshard`: already keyed by name
            self._param_groups = self._param_groups or saved["param_groups"]
            return {n: ParamState(p["master"], p["group"], dict(p["state"])) for n, p in saved["params"].items()}
        if "optimizer_names" not in saved:
            raise CheckpointError(f"{self.folder}: its stage-0 optimizer file predates resharding (no parameter "
                                  "names); load it under the layout it was written with")
        sd = saved["optimizer"]
        self._param_groups = self._param_groups or sd["param_groups"]
        copies = iter(saved["master_weights"])
        masters = {n: next(copies) for n, c in zip(saved["names"], saved["master_params_are_copies"]) if c}
        model = self._tensors_of(_model_file(pp, tp, self.layout, ep))
        out = {}
        for g, group in enumerate(sd["param_groups"]):
            for index in group["params"]:
                name = saved["optimizer_names"][index]
                master = masters[name] if name in masters else model[name].float()
                out[name] = ParamState(master, g, dict(sd["state"].get(index, {})))
        return out

    # -- whole tensors ---------------------------------------------------------------------------

    def param_groups(self) -> list[dict]:
        """The optimizer's param groups (hyperparameters; 'params' as saved)."""
        if self._param_groups is None:
            for shard in next(iter(self.tensors.values()))["shards"]:
                self._position(shard["pp"], shard["tp"], shard.get("ep", 0))
        return self._param_groups or []

    def param_state(self, name: str) -> ParamState | None:
        """The whole fp32 master and optimizer state of parameter `name` (None for buffers)."""
        name = self.tied.get(name, name)
        entry = self.entry(name)
        for pp in sorted({s["pp"] for s in entry["shards"]}):
            ep = min(s.get("ep", 0) for s in entry["shards"] if s["pp"] == pp)  # dense: in every ep file
            local = self._position(pp, 0, ep).get(name)
            if local is None:
                continue  # a stage holding a tied copy, not the parameter
            spec = self.spec(name)
            if spec is None or self.layout["tp"] == 1:
                return local
            parts = [local] + [self._position(pp, t, ep)[name] for t in range(1, self.layout["tp"])]
            merged = ParamState(spec.merge([p.master for p in parts]), local.group, dict(local.state))
            for key in local.per_element():
                merged.state[key] = spec.merge([p.state[key] for p in parts])
            return merged
        return None

    def model_tensor(self, name: str) -> torch.Tensor | None:
        """`name` as saved in the model files (whole), or None for a stage-3 parameter."""
        name = self.tied.get(name, name)
        shards = self.entry(name)["shards"]
        if any(s["file"] == ZERO_PARTITIONS for s in shards):
            return None
        spec = self.spec(name)
        if spec is None or self.layout["tp"] == 1:
            return self._tensors_of(shards[0]["file"])[name]
        pp, ep = shards[0]["pp"], shards[0].get("ep", 0)
        by_tp = {s["tp"]: s["file"] for s in shards if s["pp"] == pp and s.get("ep", 0) == ep}
        return spec.merge([self._tensors_of(by_tp[t])[name] for t in range(self.layout["tp"])])

    def value(self, name: str) -> torch.Tensor:
        """The whole tensor: a parameter's fp32 master, else the saved buffer."""
        state = self.param_state(name)
        if state is not None:
            return state.master
        saved = self.model_tensor(name)
        if saved is None:
            raise CheckpointError(f"{self.folder}: parameter {name!r} is in no partition; the checkpoint is "
                                  "incomplete")
        return saved


def _model_file(pp: int, tp: int, layout: dict, ep: int = 0) -> str:
    if layout["pp"] == 1 and layout["tp"] == 1 and layout.get("ep", 1) == 1:
        return "model.safetensors"
    return f"model_pp{pp}{_ep_part(ep, layout)}_tp{tp}.safetensors"


def _ep_part(ep: int, layout: dict) -> str:
    """`_ep<E>` in the file names of a checkpoint written with ep > 1 (trident.checkpointing.state)."""
    return f"_ep{ep}" if layout.get("ep", 1) > 1 else ""


def _scatter_partition(out: dict[str, ParamState], group: dict, chunk_states: list[dict], rank: int) -> None:
    """Write one rank's partition group (masters + optimizer state per chunk) into whole tensors."""
    layout = ShardedLayout.from_dict(group["layout"])
    masters = group["masters"]
    flats = {"master": torch.cat([m.reshape(-1).float() for m in masters]) if masters else torch.zeros(0)}
    scalars: dict[str, Any] = {}
    keys = {k for s, m in zip(chunk_states, masters) for k, v in s.items()
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == m.numel()}
    for key in keys:
        flats[key] = torch.cat([s[key].reshape(-1).float() if key in s else torch.zeros(m.numel())
                                for s, m in zip(chunk_states, masters)])
    for s in chunk_states:
        for k, v in s.items():
            if k not in keys:
                scalars.setdefault(k, v)
    for unit in layout.units:
        lo, _ = unit.shard_range(rank)
        for slot, a, b in unit.pieces(rank):
            name = group["names"][slot.index]
            ps = out.get(name)
            if ps is None:
                ps = out[name] = ParamState(torch.zeros(slot.shape), group["opt_group"], dict(scalars))
                for key in keys:
                    ps.state[key] = torch.zeros(slot.shape)
            start = unit.partition_offset + slot.offset + a - lo
            ps.master.view(-1)[a:b] = flats["master"][start:start + b - a]
            for key in keys:
                ps.state[key].view(-1)[a:b] = flats[key][start:start + b - a]


# -- loading under this engine's layout --------------------------------------------------------


def local_value(value: torch.Tensor, target: torch.Tensor, tp_rank: int, name: str, folder: Path,
                strategy) -> torch.Tensor:
    """`value` (whole) cut to what `target` holds on this tp rank; shapes checked."""
    spec = getattr(target, "tp_spec", None) if getattr(target, "tensor_model_parallel", False) else None
    if spec is not None and spec.tp_size > 1:
        if value.shape[spec.dim] != spec.full_size:
            raise CheckpointError(f"{folder}: tensor {name!r} has size {value.shape[spec.dim]} along dim {spec.dim}, "
                                  f"this model's is {spec.full_size}; the checkpoint is of another model")
        return spec.shard(value, tp_rank)
    shape = global_shape(target, strategy)
    if tuple(value.shape) != shape:
        raise CheckpointError(f"{folder}: tensor {name!r} has shape {tuple(value.shape)}, this model's is "
                              f"{shape}; the checkpoint is of another model")
    return value


def prepare_resharded(engine, reader: CheckpointReader, load_optimizer_states: bool) -> Callable[[], None]:
    """Read everything `engine` needs from a checkpoint written under any layout: weights, fp32
    masters and (optionally) optimizer state, cut for this rank. Returns the function that puts
    them in place; reading uses no collective, so a bad file fails before any rank commits."""
    mesh, strategy, folder = engine.mesh, engine.strategy, reader.folder
    params = dict(engine.module.named_parameters())
    partitioned = {id(p) for p in params.values() if is_partitioned(p, strategy)}
    entries = {}
    for name, t in engine.module.state_dict(keep_vars=True).items():
        if id(t) in partitioned:
            continue
        entries[name] = local_value(reader.value(name), t, mesh.tp_rank, name, folder, strategy).to(t.dtype)

    def local_state(name: str) -> ParamState:
        state = reader.param_state(name)
        target = params[name]
        if state is None:
            if target.requires_grad:
                raise _missing(folder, name)
            state = ParamState(reader.value(name).float(), -1, {})  # frozen: its value, no state
        cut = ParamState(local_value(state.master, target, mesh.tp_rank, name, folder, strategy), state.group,
                         dict(state.state))
        for key, v in state.per_element().items():
            cut.state[key] = local_value(v, target, mesh.tp_rank, name, folder, strategy)
        return cut

    skeleton = strategy.state_dict()
    groups = reader.param_groups()
    if len(groups) != len(skeleton["optimizer"]["param_groups"]):
        raise CheckpointError(f"{folder}: the checkpoint's optimizer has {len(groups)} param group(s), this "
                              f"engine's has {len(skeleton['optimizer']['param_groups'])}; build the optimizer "
                              "with the same param groups")
    for mine, saved in zip(skeleton["optimizer"]["param_groups"], groups):
        mine.update({k: v for k, v in saved.items() if k != "params"})
    strategy.fill_resharded_state(skeleton, local_state, str(folder))

    def apply() -> None:
        engine.module.load_state_dict(entries, strict=not strategy.partitions_parameters)
        strategy.load_state_dict(skeleton, load_optimizer_states=load_optimizer_states)
    return apply


def _missing(folder: Path, name: str) -> CheckpointError:
    return CheckpointError(f"{folder}: holds no optimizer state for parameter {name!r}; the checkpoint is of "
                           "another model (or that parameter was frozen when it was saved)")


# -- offline: write the checkpoint for another layout -------------------------------------------


def reshard(src: str | Path, out: str | Path, pp: int, tp: int, dp: int) -> Path:
    """Write `src` (a checkpoint folder) as a checkpoint for pp x dp x tp at `out`.

    The result is in stage-0 form: per (pp, tp) position a model file and an optimizer file
    keyed by parameter name (fp32 masters and optimizer state sliced for that tp rank). ZeRO
    partitions are not written, because how a run cuts them depends on its bucket and
    sub-group sizes; a run under ZeRO cuts them when it loads (every load goes by name). Names
    are placed on stages by the checkpoint's own placement when pp is unchanged, else by
    parameter count over the layer indices of a PipelineModule's names.
    """
    for flag, v in (("--pp", pp), ("--tp", tp), ("--dp", dp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"reshard: {flag} must be a positive integer, got {v!r}")
    reader = CheckpointReader(src)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out}: exists and is not empty; choose a new folder for the resharded checkpoint")
    if tp > 1 and reader.layout["tp"] == 1 and not any("tp_split" in e for e in reader.tensors.values()):
        raise CheckpointError(f"{reader.folder}: written at tp=1 without tensor-parallel split information, so "
                              f"the offline tool cannot tell which tensors tp={tp} splits. Load it with "
                              "trident.initialize under the new layout (any layout loads it) and save again")
    stages = _place_on_stages(reader, pp)
    partial = out.parent / f".{out.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    files: dict[str, str] = {}
    tensors: dict[str, dict] = {}
    names = [n for n in reader.tensors if n not in reader.tied]
    for p in range(pp):
        mine = [n for n in names if p in stages[n]]
        for t in range(tp):
            model, params = {}, {}
            for name in mine:
                spec = reader.spec(name, tp)
                entry = reader.entry(name)
                dtype = getattr(torch, entry["dtype"])

                def cut(x: torch.Tensor) -> torch.Tensor:
                    return spec.shard(x, t) if spec is not None and tp > 1 else x.contiguous()

                state = reader.param_state(name)
                model[name] = cut(reader.value(name)).to(dtype)
                if state is not None and state.group >= 0 and (p == min(stages[name])):  # -1: frozen
                    params[name] = {"group": state.group, "master": cut(state.master),
                                    "state": {k: cut(v) if k in state.per_element() else v
                                              for k, v in state.state.items()}}
                record = tensors.setdefault(name, {k: v for k, v in entry.items() if k != "shards"} | {"shards": []})
                if spec is None or tp == 1:
                    record.pop("tp_split", None)
                    sl = [[0, n] for n in entry["global_shape"]]
                else:
                    sl = [[0, n] for n in entry["global_shape"]]
                    local = spec.local_size
                    sl[spec.dim] = [t * local, (t + 1) * local]
                    record["tp_split"] = {"dim": spec.dim, "stride": spec.stride, "padded_size": spec.padded_size}
                model_name = _model_file(p, t, {"pp": pp, "tp": tp})
                record["shards"].append({"file": model_name, "pp": p, "tp": t, "slice": sl})
            model_name = _model_file(p, t, {"pp": pp, "tp": tp})
            files[model_name] = write_hashed(partial / model_name, safetensors_bytes(model))
            optim_name = f"optim_pp{p}_tp{t}.pt"
            files[optim_name] = write_hashed(partial / optim_name, {"stage": 0, "format": "named", "params": params,
                                                                    "param_groups": reader.param_groups()})
    for extra in (STATE_FILE, CLIENT_FILE):
        if extra in reader.manifest["files"]:
            shutil.copyfile(reader.folder / extra, partial / extra)
            files[extra] = sha256_of(partial / extra)
    manifest = {
        "format_version": FORMAT_VERSION, "tag": out.name, "global_steps": reader.manifest.get("global_steps", 0),
        "layout": {"world_size": pp * dp * tp, "pp": pp, "dp": dp, "tp": tp, "zero_stage": 0},
        "resharded_from": reader.layout, "tensors": tensors, "tied": reader.tied,
        "files": {f: {"sha256": digest, "bytes": (partial / f).stat().st_size} for f, digest in sorted(files.items())},
    }
    if "lora" in reader.manifest:  # the adapters' scaling, for merge-lora
        manifest["lora"] = reader.manifest["lora"]
    (partial / MANIFEST).write_text(json.dumps(manifest, indent=1))
    if out.exists():
        out.rmdir()
    os.replace(partial, out)
    return out


def _place_on_stages(reader: CheckpointReader, pp: int) -> dict[str, set[int]]:
    """Which stages' files hold each name under `pp` stages."""
    names = [n for n in reader.tensors if n not in reader.tied]
    if pp == reader.layout["pp"]:
        return {n: {s["pp"] for s in reader.tensors[n]["shards"]} for n in names}
    if pp == 1:
        return {n: {0} for n in names}
    layer_of = {}
    for n in names:
        head = n.split(".", 1)[0]
        if head.isdigit():
            layer_of[n] = int(head)
        elif not n.startswith("tied_modules."):
            raise CheckpointError(f"{reader.folder}: tensor {n!r} is not named like a PipelineModule layer "
                                  f"('<layer index>.<name>'), so the offline tool cannot place it on {pp} stages; "
                                  "load the checkpoint under the new layout with trident.initialize and save again")
    from trident.pipeline.partition import partition_layers
    layers = max(layer_of.values(), default=0) + 1
    counts = [0] * layers
    for n, i in layer_of.items():
        counts[i] += reader.entry(n).get("numel") or _numel(reader.entry(n)["global_shape"])
    bounds = partition_layers("parameters", pp, ["layer"] * layers, counts)
    stage_of = {i: s for s in range(pp) for i in range(bounds[s], bounds[s + 1])}
    return {n: ({stage_of[layer_of[n]]} if n in layer_of else {0, pp - 1}) for n in names}


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
