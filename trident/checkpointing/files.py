"""The on-disk form of an engine checkpoint: file names, the manifest, hashed writes and verified
reads (trident.checkpointing.state writes and loads checkpoints with them; reshard, consolidate,
inspect and the DeepSpeed import read them)."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import torch
from safetensors.torch import load_file


FORMAT_VERSION = 3
LATEST = "latest"
MODEL_FILE = "model.safetensors"
STATE_FILE = "training_state.pt"
CLIENT_FILE = "client_state.pt"
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the file."""


def sha256_of(path: Path) -> str:
    """The file's sha256 (hex), read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


class _HashingWriter(io.RawIOBase):
    """A file that hashes what passes through it, so a checkpoint file is read zero times to
    get its checksum."""

    def __init__(self, f) -> None:
        self.f, self.hash = f, hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.hash.update(data)
        return self.f.write(data)


def write_hashed(path: Path, obj) -> str:
    """Write `obj` (bytes as they are, anything else with torch.save); returns the sha256."""
    with open(path, "wb") as f:
        if isinstance(obj, bytes):
            f.write(obj)
            return hashlib.sha256(obj).hexdigest()
        writer = _HashingWriter(f)
        torch.save(obj, writer)
        return writer.hash.hexdigest()


def zero_file(mesh) -> str:
    """Name of this rank's ZeRO partition file."""
    return f"zero_pp{mesh.pp_rank}{_ep_part(mesh)}_tp{mesh.tp_rank}_dp{partition_index(mesh)}.pt"


def partition_index(mesh) -> int:
    """This rank's place among the dp x cp ranks that share a ZeRO partition group (cp ranks
    hold different parts of the same sequences, so they partition like more dp ranks; the
    group's ranks follow mesh order, dp outer). With cp = 1 it is the dp rank."""
    return mesh.dp_rank * mesh.cp_size + mesh.cp_rank


def _ep_part(mesh) -> str:
    """`_ep<E>` in file names when ep ranks hold different experts, else nothing."""
    return f"_ep{mesh.ep_rank}" if mesh.ep_size > 1 else ""


def is_partitioned(t: torch.Tensor, strategy) -> bool:
    """Whether the engine's gradient strategy holds `t` only as shards (ZeRO-3's parameters)."""
    return strategy.partitions(t)


def tied_names(module: torch.nn.Module) -> dict[str, str]:
    """State-dict entries that are the same tensor as an earlier entry: alias -> first name."""
    first: dict[int, str] = {}
    tied = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) in first:
            tied[name] = first[id(t)]
        else:
            first[id(t)] = name
    return tied


def model_file(mesh) -> str:
    """Name of the model file of this rank's (pp, tp) position."""
    if mesh.pp_size == 1 and mesh.tp_size == 1 and mesh.ep_size == 1:
        return MODEL_FILE
    return f"model_pp{mesh.pp_rank}{_ep_part(mesh)}_tp{mesh.tp_rank}.safetensors"


def optim_file(mesh) -> str:
    """Name of the stage-0 optimizer state file of this rank's (pp, tp) position."""
    return f"optim_pp{mesh.pp_rank}{_ep_part(mesh)}_tp{mesh.tp_rank}.pt"


def global_shape(t: torch.Tensor, strategy) -> tuple[int, ...]:
    """A tensor's whole (un-ZeRO-partitioned) shape, as the engine's strategy knows it; tp slicing
    is not undone."""
    return strategy.full_shape(t) if strategy.partitions(t) else tuple(t.shape)


def read_manifest(folder: Path) -> dict:
    """The manifest of a checkpoint folder, checked for the keys loading relies on."""
    path = folder / MANIFEST
    if not path.exists():
        raise CheckpointError(f"{path}: missing; {folder} is not a complete trident checkpoint")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: unreadable ({err}); the checkpoint is damaged, load another tag") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(manifest).__name__}; the checkpoint "
                              "is damaged, load another tag")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"{path}: format_version {version!r} is not one this trident reads (up to "
                              f"{FORMAT_VERSION}); it was written by a newer trident: upgrade trident to load it")
    for key, kind in (("files", dict), ("layout", dict), ("tensors", dict)):
        if not isinstance(manifest.get(key), kind):
            raise CheckpointError(f"{path}: the manifest has no valid '{key}' entry; the checkpoint is damaged, "
                                  "load another tag")
    for name, entry in manifest["files"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
            raise CheckpointError(f"{path}: the entry of file {name!r} has no sha256; the checkpoint is damaged")
    return manifest


def load_tensors(folder: Path, manifest: dict, name: str) -> dict[str, torch.Tensor]:
    """A verified safetensors file of the checkpoint."""
    path = _verified(folder, manifest, name)
    try:
        return load_file(str(path))
    except Exception as err:  # safetensors raises its own error types for a malformed header
        raise CheckpointError(f"{path}: not a readable safetensors file ({err}); the checkpoint is damaged") from None


def load_pickle(folder: Path, manifest: dict, name: str):
    """A verified torch.save file of the checkpoint."""
    path = _verified(folder, manifest, name)
    try:
        return torch.load(path, weights_only=False)
    except Exception as err:  # unpickling errors come in many types
        raise CheckpointError(f"{path}: not a readable torch file ({err}); the checkpoint is damaged") from None


def _verified(folder: Path, manifest: dict, name: str) -> Path:
    """The file's path once its sha256 matches the manifest's (hashing leaves it in the page
    cache for the load that follows). The names checked are remembered in the (in-memory)
    manifest under "_read", so `_verify_share` skips them."""
    path = folder / name
    entry = manifest["files"].get(name)
    if entry is None:
        raise CheckpointError(f"{path}: not listed in {folder / MANIFEST}; the checkpoint is incomplete")
    if not path.exists():
        raise CheckpointError(f"{path}: file missing (listed in the manifest); the checkpoint is incomplete")
    check_digest(path, sha256_of(path), entry)
    manifest.setdefault("_read", set()).add(name)
    return path


def check_digest(path: Path, digest: str, entry: dict) -> None:
    if digest != entry["sha256"]:
        raise CheckpointError(f"{path}: checksum mismatch (sha256 {digest[:12]}..., manifest says "
                              f"{entry['sha256'][:12]}...); the file is corrupt, load another tag")


def resolve_tag(load_dir: str, tag: str | None) -> str | None:
    """The tag to load: the given one, or the one named in `latest` (None if there is none)."""
    if tag is not None:
        return tag
    latest = Path(load_dir) / LATEST
    if not latest.exists():
        return None
    tag = latest.read_text().strip()
    if not tag:
        raise CheckpointError(f"{latest}: empty; it should name the newest checkpoint folder. Write that "
                              "folder's name into it, or pass tag= explicitly")
    return tag
