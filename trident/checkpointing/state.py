"""Engine checkpoints: written atomically, described by a manifest, verified on load.

Layout of `save_dir/<tag>/`:

  model.safetensors       model weights in the model's dtype, written by data-parallel rank 0
                          (with pp or tp > 1: model_pp<P>_tp<T>.safetensors, one per position);
                          under ZeRO stage 3 only the buffers (parameters live in the partitions)
  optim_pp<P>_tp<T>.pt    stage 0: optimizer state and fp32 masters (data-parallel rank 0)
  zero_pp<P>_tp<T>_dp<D>.pt   ZeRO stages 1-3: each rank's partition (its layout, fp32 master
                          shards and the optimizer state over them), written by that rank
  (with expert parallelism, ep > 1, every ep rank holds other experts: the names above gain
  `_ep<E>` after the pp part, and each ep rank's files hold the dense tensors and its experts,
  keyed by global expert index, so any ep size can read them)
  training_state.pt       step counters, scheduler, loss scaler (shared by all ranks)
  client_state.pt         the caller's `client_state` dict (arbitrary picklable objects)
  rng_rank<R>.pt          every rank's RNG states, so dropout resumes exactly
  manifest.json           layout, every tensor's global shape and the slice each file holds,
                          tied names, and every file's size and sha256

Atomicity: all ranks write into `save_dir/.<tag>.partial/`; after a barrier the first rank
writes the manifest, renames the folder to `<tag>` and only then replaces `latest`. A crash
at any moment leaves the previous checkpoint and `latest` untouched.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save as safetensors_bytes

from trident.checkpointing.reshard import CheckpointReader, prepare_resharded
from trident.comm import collectives
from trident.monitor.log import logger
from trident.checkpointing.files import (CLIENT_FILE, CheckpointError, FORMAT_VERSION, LATEST, MANIFEST,
                                          MODEL_FILE, STATE_FILE, global_shape, is_partitioned, load_pickle,
                                          load_tensors, model_file, optim_file, partition_index,
                                          read_manifest, resolve_tag, sha256_of, tied_names, write_hashed,
                                          zero_file, check_digest)

__all__ = ["load_checkpoint", "prune_checkpoints", "save_checkpoint",  # and the format's names, for callers
           "CLIENT_FILE", "FORMAT_VERSION", "LATEST", "MANIFEST", "MODEL_FILE", "STATE_FILE", "CheckpointError",
           "global_shape", "is_partitioned", "load_pickle", "load_tensors", "read_manifest", "resolve_tag",
           "sha256_of", "write_hashed"]


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _with_data_position(engine, client_state: dict) -> dict:
    """`client_state` plus the training loader's position under "sampler" when the caller gave
    none, so every checkpoint of an engine with a loader resumes the data exactly (the position
    is global: rank 0's is every rank's)."""
    sampler = getattr(getattr(engine, "training_dataloader", None), "sampler", None)
    if "sampler" in client_state or not hasattr(sampler, "state_dict"):
        return client_state
    return {**client_state, "sampler": sampler.state_dict()}


def save_checkpoint(engine, save_dir: str, tag: str | None, client_state: dict, save_latest: bool,
                    records: dict[str, dict] | None = None) -> str:
    """Write one checkpoint of `engine`; returns the final checkpoint folder. `records` go into
    the manifest under their keys (what the layers above know about the model: its LoRA
    scaling, its transformers config), for the offline tools that read them."""
    tag = tag or f"global_step{engine.global_steps}"
    if "/" in tag or tag.startswith("."):
        raise ValueError(f"checkpoint tag {tag!r} must be a plain folder name (no '/', not starting with '.')")
    root = Path(save_dir)
    partial, final = root / f".{tag}.partial", root / tag
    group = engine.mesh.mesh_group
    rank = engine.mesh.mesh_rank
    per_rank = engine.strategy.per_rank_state
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    collectives.barrier(group=group)

    files: dict[str, str] = {}
    tensors: dict[str, dict] = {}

    def write(name: str, obj) -> None:
        files[name] = write_hashed(partial / name, obj)

    write(f"rng_rank{rank}.pt", _rng_state())
    if per_rank:  # every rank: its own partition
        write(zero_file(engine.mesh), engine.strategy.state_dict())
    if partition_index(engine.mesh) == 0:  # one replica per (pp, tp) position writes what replicas share
        model = model_file(engine.mesh)
        write(model, safetensors_bytes(_model_tensors(engine)))
        tensors = _tensor_entries(engine, model)
        if not per_rank:
            write(optim_file(engine.mesh), engine.strategy.state_dict())
    if rank == 0:
        write(STATE_FILE, engine.training_state())
        write(CLIENT_FILE, _with_data_position(engine, client_state))
    gathered: list = [None] * engine.mesh.world_size
    collectives.all_gather_object(gathered, (files, tensors, tied_names(engine.module)), group=group)
    if rank == 0:
        checksums = {name: digest for per_rank, _, _ in gathered for name, digest in per_rank.items()}
        entries: dict[str, dict] = {}
        tied: dict[str, str] = {}
        for _, per_rank, tied_here in gathered:
            tied.update(tied_here)
            for name, entry in per_rank.items():
                entries.setdefault(name, {**entry, "shards": []})["shards"] += entry["shards"]
        _write_manifest(engine, partial, tag, checksums, entries, tied, records or {})
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        if save_latest:
            tmp = root / f".{LATEST}.tmp"
            tmp.write_text(tag)
            os.replace(tmp, root / LATEST)
        logger.info("saved checkpoint %s", final)
    collectives.barrier(group=group)
    return str(final)


def _model_tensors(engine) -> dict[str, torch.Tensor]:
    """What model.safetensors holds: the whole state dict, or under stage 3 only what is not a
    partitioned parameter. Tied entries are written once (safetensors refuses shared storage)."""
    out, seen = {}, set()
    for name, t in engine.module.state_dict(keep_vars=True).items():
        if id(t) in seen or is_partitioned(t, engine.strategy):
            continue
        seen.add(id(t))
        out[name] = t.detach().contiguous().clone()
    return out


def _tensor_entries(engine, file: str) -> dict[str, dict]:
    """For each state-dict entry this rank holds: global shape, dtype, and the slice of the
    global tensor its file (or, under stage 3, the ZeRO partitions) holds."""
    stored = set(_model_tensors(engine))
    mesh = engine.mesh
    out = {}
    for name, t in engine.module.state_dict(keep_vars=True).items():
        local = list(global_shape(t, engine.strategy))
        shape = list(local)
        spec = getattr(t, "tp_spec", None) if getattr(t, "tensor_model_parallel", False) else None
        sl = [[0, n] for n in local]
        entry = {"global_shape": shape, "dtype": str(t.dtype).replace("torch.", "")}
        if spec is not None:
            # Rank r holds rows [r * local, (r + 1) * local) of each of `stride` fused blocks of the
            # (padded) dim; the padding rows past full_size are not part of the global tensor.
            shape[spec.dim] = spec.full_size
            sl[spec.dim] = [mesh.tp_rank * local[spec.dim], (mesh.tp_rank + 1) * local[spec.dim]]
            entry["tp_split"] = {"dim": spec.dim, "stride": spec.stride, "padded_size": spec.padded_size}
        entry["shards"] = [{"file": file if name in stored else "zero partitions",
                            "pp": mesh.pp_rank, "tp": mesh.tp_rank, "ep": mesh.ep_rank, "slice": sl}]
        out[name] = entry
    return out


def _write_manifest(engine, folder: Path, tag: str, checksums: dict[str, str], tensors: dict[str, dict],
                    tied: dict[str, str], records: dict[str, dict]) -> None:
    mesh = engine.mesh
    manifest = {
        "format_version": FORMAT_VERSION,
        "tag": tag,
        "global_steps": engine.global_steps,
        "layout": {"world_size": mesh.world_size, "pp": mesh.pp_size, "dp": mesh.dp_size, "cp": mesh.cp_size,
                   "tp": mesh.tp_size, "ep": mesh.ep_size, "zero_stage": engine.strategy.zero_stage},
        "tensors": tensors,
        "tied": tied,
        "files": {name: {"sha256": digest, "bytes": (folder / name).stat().st_size}
                  for name, digest in sorted(checksums.items())},
    }
    manifest.update({key: record for key, record in records.items() if record is not None})
    tmp = folder / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, folder / MANIFEST)


def prune_checkpoints(save_dir: str, keep_last: int) -> list[str]:
    """Delete all but the newest `keep_last` complete checkpoints (by global step) under
    save_dir, never the one `latest` names; returns the deleted tags."""
    root = Path(save_dir)
    done = []
    for folder in root.iterdir():
        manifest = folder / MANIFEST
        if folder.is_dir() and not folder.name.startswith(".") and manifest.exists():
            done.append((json.loads(manifest.read_text()).get("global_steps", 0), folder))
    latest = resolve_tag(save_dir, None)
    deleted = []
    for _, folder in sorted(done)[:-keep_last] if keep_last else []:
        if folder.name != latest:
            shutil.rmtree(folder, ignore_errors=True)
            deleted.append(folder.name)
    return deleted


def _same_layout_partition(engine, folder: Path, manifest: dict):
    """None (no per-rank state) or this rank's partition dict when the checkpoint was written
    under this engine's exact layout and partitioning; False when it must be resharded."""
    layout, mesh, strategy = manifest["layout"], engine.mesh, engine.strategy
    same = (not manifest.get("resharded_from") and layout.get("zero_stage", 0) == strategy.zero_stage
            and (layout["pp"], layout["tp"], layout.get("ep", 1)) == (mesh.pp_size, mesh.tp_size, mesh.ep_size)
            and (not strategy.per_rank_state or (layout["dp"], layout.get("cp", 1)) == (mesh.dp_size, mesh.cp_size)))
    if not same:
        return False
    partition = load_pickle(folder, manifest, zero_file(mesh)) if strategy.per_rank_state else None
    return partition if strategy.same_state_layout(partition) else False  # other bucket sizes: reshard


def _prepare_same_layout(engine, folder: Path, manifest: dict, partition: dict | None, optimizer: bool):
    """The fast path: this rank's own files, read now, applied by the returned function."""
    strategy = engine.strategy
    state = load_tensors(folder, manifest, model_file(engine.mesh))
    for alias, name in manifest.get("tied", {}).items():
        if name in state:
            state[alias] = state[name]
    strategy_state = partition if strategy.per_rank_state else (
        load_pickle(folder, manifest, optim_file(engine.mesh)) if optimizer else None)

    def apply() -> None:
        engine.module.load_state_dict(state, strict=not strategy.partitions_parameters)
        if strategy_state is not None:
            strategy.load_state_dict(strategy_state, load_optimizer_states=optimizer)
        else:
            strategy.reload_masters()
    return apply


def load_checkpoint(engine, load_dir: str, tag: str | None, load_optimizer_states: bool,
                    load_lr_scheduler_states: bool, load_module_only: bool):
    """Load into `engine`; returns (folder, client_state) or (None, None) without a checkpoint."""
    tag = resolve_tag(load_dir, tag)
    if tag is None:
        logger.warning("no checkpoint to load: %s has no '%s' file", load_dir, LATEST)
        return None, None
    folder = Path(load_dir) / tag
    optimizer = load_optimizer_states and not load_module_only
    try:  # read every file this rank needs before any rank changes anything
        manifest = read_manifest(folder)
        partition = _same_layout_partition(engine, folder, manifest)
        if partition is False:  # written under another layout: cut it for this one
            layout = manifest["layout"]
            logger.info("checkpoint %s was written with pp=%d dp=%d tp=%d ZeRO-%d; resharding it for pp=%d dp=%d "
                        "tp=%d ZeRO-%d", folder, layout["pp"], layout["dp"], layout["tp"], layout["zero_stage"],
                        engine.mesh.pp_size, engine.mesh.dp_size, engine.mesh.tp_size, engine.strategy.zero_stage)
            apply = prepare_resharded(engine, CheckpointReader(folder), optimizer)
        else:
            apply = _prepare_same_layout(engine, folder, manifest, partition, optimizer)
        training = client_state = rng = None
        if not load_module_only:
            training = load_pickle(folder, manifest, STATE_FILE)
            client_state = load_pickle(folder, manifest, CLIENT_FILE)
            rng_name = f"rng_rank{engine.mesh.mesh_rank}.pt"
            if rng_name in manifest["files"] and manifest["layout"]["world_size"] == engine.mesh.world_size:
                rng = load_pickle(folder, manifest, rng_name)
        _verify_share(folder, manifest, engine.mesh.mesh_rank, engine.mesh.world_size)
        error = None
    except CheckpointError as err:
        error = str(err)
    _agree_or_raise(engine, error)
    apply()
    if training is not None:
        engine.load_training_state(training, load_optimizer_states, load_lr_scheduler_states)
        if partition is False:  # accumulation steps may differ under the new layout: restart at a boundary
            engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps()
    if rng is not None:
        _set_rng_state(rng)
    engine.strategy.zero_grad()
    collectives.barrier(group=engine.mesh.mesh_group)
    logger.info("loaded checkpoint %s (step %d)", folder, engine.global_steps)
    return str(folder), client_state or {}


def _verify_share(folder: Path, manifest: dict, rank: int, world: int) -> None:
    """Check this rank's share of the checkpoint's files (every world-th), so a damaged file is
    named even when this layout does not read it (a model file whose weights come from the fp32
    masters, another layout's RNG states)."""
    for name in sorted(manifest["files"])[rank::world]:
        if name in manifest.get("_read", ()):
            continue
        path = folder / name
        if not path.exists():
            raise CheckpointError(f"{path}: file missing (listed in the manifest); the checkpoint is incomplete")
        check_digest(path, sha256_of(path), manifest["files"][name])


def _agree_or_raise(engine, error: str | None) -> None:
    """Every rank learns whether any rank failed to read its files; all raise the first error."""
    errors: list = [None] * engine.mesh.world_size
    collectives.all_gather_object(errors, error, group=engine.mesh.mesh_group)
    failed = [(rank, e) for rank, e in enumerate(errors) if e]
    if failed:
        rank, first = failed[0]
        more = f" ({len(failed) - 1} other rank(s) failed too)" if len(failed) > 1 else ""
        raise CheckpointError(f"{first} [read by rank {rank}{more}]")
