"""A 3D checkpoint (pp 2 x tp 2, ZeRO-1 partitions) on disk: `trident checkpoint inspect |
reshard | consolidate`, and damage: a truncated or altered shard is named by every rank that
loads, under the same layout and under another; a save that died half way leaves the previous
checkpoint loadable (the kill itself is exercised in test_elastic)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trident.checkpointing.state import CheckpointError
from trident.cli.main import main
from trident.models.gpt import GPTConfig
from trident.models.gpt_pipe import gpt_pipe, gpt_state_dict
from trident.testing.distributed import run_on_ranks
from trident.testing.parity import assert_state_close
from tests.distributed.test_reshard import MODEL, SAVE_AT, _pipe_engine, merged, pipe_run

LAYOUT = (2, 1, 2, 1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The checkpoint folder and the merged weights the saving run ended with."""
    root = tmp_path_factory.mktemp("ckpt3d")
    _, weights = merged(run_on_ranks(4, pipe_run, LAYOUT, str(root), "save"))
    return root, weights


def _copy(saved, tmp_path: Path) -> Path:
    root = tmp_path / "copy"
    shutil.copytree(saved[0], root)
    return root


def test_inspect_prints_layout_tensors_and_files(saved, capsys):
    root, _ = saved
    assert main(["checkpoint", "inspect", str(root), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "pp 2 x dp 1 x tp 2 = 4 ranks, ZeRO stage 1" in out
    assert "2.attn.qkv.weight" in out and "tp dim 0" in out
    assert "zero_pp1_tp1_dp0.pt" in out and " ok" in out
    assert "tied_modules.embed.weight" in out


def test_reshard_command_then_inspect(saved, tmp_path, capsys):
    root, _ = saved
    out = tmp_path / "one"
    assert main(["checkpoint", "reshard", str(root), str(out), "--pp", "1", "--tp", "1", "--dp", "1"]) == 0
    capsys.readouterr()
    assert main(["checkpoint", "inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "pp 1 x dp 1 x tp 1" in text and "resharded from pp 2 x dp 1 x tp 2, ZeRO stage 1" in text
    assert main(["checkpoint", "reshard", str(root), str(out), "--pp", "1", "--tp", "1", "--dp", "1"]) == 1
    assert "not empty" in capsys.readouterr().err


def test_consolidate_loads_into_the_unsplit_model(saved, tmp_path):
    root, weights = saved
    out = tmp_path / "full.safetensors"
    assert main(["checkpoint", "consolidate", str(root), str(out)]) == 0
    cfg = GPTConfig(**MODEL)
    model = gpt_pipe(cfg, 1, partition_method="uniform", stage_id=0)
    missing, unexpected = model.load_state_dict(load_file(str(out)), strict=False)
    assert not missing and not unexpected
    assert_state_close({k: v.float() for k, v in gpt_state_dict(model, cfg).items()}, weights, rtol=1e-6)


def try_load(layout, root: str) -> str:
    engine, _ = _pipe_engine(layout)
    try:
        engine.load_checkpoint(root)
    except CheckpointError as err:
        return str(err)
    return f"loaded step {engine.global_steps}"


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("file,damage", [("model_pp1_tp1.safetensors", _truncate), ("zero_pp0_tp1_dp0.pt", _flip)])
@pytest.mark.parametrize("layout", [LAYOUT, (1, 1, 1, 0)], ids=["same-layout", "resharded"])
def test_damaged_shard_is_named_on_every_rank(saved, tmp_path, capsys, file, damage, layout):
    root = _copy(saved, tmp_path)
    damage(root / f"global_step{SAVE_AT}" / file)
    pp, dp, tp, _ = layout
    for message in run_on_ranks(pp * dp * tp, try_load, layout, str(root)):
        assert file in message and "checksum mismatch" in message, message
    assert main(["checkpoint", "inspect", str(root), "--verify"]) == 1
    assert f"damaged files: {file}" in capsys.readouterr().err


def test_a_save_that_died_half_way_leaves_the_previous_checkpoint(saved, tmp_path):
    """What a kill during the next save leaves: its partial folder, `latest` unchanged."""
    root = _copy(saved, tmp_path)
    partial = root / ".global_step9.partial"
    partial.mkdir()
    shutil.copy(root / f"global_step{SAVE_AT}" / "zero_pp0_tp0_dp0.pt", partial)
    _truncate(partial / "zero_pp0_tp0_dp0.pt")
    assert (root / "latest").read_text() == f"global_step{SAVE_AT}"
    for message in run_on_ranks(1, try_load, (1, 1, 1, 0), str(root)):
        assert message == f"loaded step {SAVE_AT}"
    manifest = json.loads((root / f"global_step{SAVE_AT}" / "manifest.json").read_text())
    assert manifest["layout"] == {"world_size": 4, "pp": 2, "dp": 1, "cp": 1, "tp": 2, "ep": 1, "zero_stage": 1}
    assert torch.load(root / f"global_step{SAVE_AT}" / "training_state.pt")["global_steps"] == SAVE_AT
