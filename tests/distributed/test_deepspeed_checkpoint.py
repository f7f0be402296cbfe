"""DeepSpeed 0.19 checkpoints (tests/fixtures/deepspeed, made by make_fixtures.py there under
DeepSpeed itself): imported without DeepSpeed, loaded under another trident layout, and
training goes on to the losses DeepSpeed recorded when it continued its own run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import trident
from trident.deepspeed.checkpoint import import_deepspeed, read_deepspeed
from trident.checkpointing.state import CheckpointError
from trident.cli.main import main as trident_main
from trident.testing.distributed import cached_mesh, cached_solo_mesh, run_on_ranks

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed"
KINDS = ("zero1", "zero3", "pipe")
# fp32 on CPU, same global batches and the same AdamW arithmetic; only the order of the
# data-parallel sums differs from DeepSpeed's, a few ulp per step.
TOLERANCE = 1e-5


def expected(kind: str) -> dict:
    return json.loads((FIXTURES / kind / "expected.json").read_text())


def continue_training(kind: str, ckpt: str, stage: int, solo: bool) -> list[float]:
    """Build the fixture's model under trident (dp = the world, ZeRO `stage`), load `ckpt` and
    train the steps DeepSpeed trained after saving; the mean loss of each global batch."""
    exp = expected(kind)
    mesh = cached_solo_mesh() if solo else cached_mesh()
    world, rank = mesh.dp_size, mesh.dp_rank
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), **{**exp["optimizer"], "betas": tuple(exp["optimizer"]["betas"])})
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8 // world, "scheduler": exp["scheduler"],
           "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "steps_per_print": 0}
    engine, *_ = trident.initialize(model=model, optimizer=opt, config=cfg, mesh=mesh)
    _, client = engine.load_checkpoint(ckpt)
    assert client == {"epoch": 1} and engine.global_steps == exp["saved_at_step"]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g)
    losses = []
    half = 8 // world
    for s in range(exp["saved_at_step"], exp["saved_at_step"] + len(exp["continued_losses"])):
        rows = slice(s * 8 + rank * half, s * 8 + (rank + 1) * half)
        loss = nn.functional.mse_loss(engine(x[rows]), y[rows])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        trident.comm.all_reduce(mean, group=mesh.dp_group)
        losses.append(mean.item() / world)
    engine.destroy()
    return losses


def _close(got: list[float], want: list[float]) -> None:
    diffs = [abs(a - b) for a, b in zip(got, want)]
    assert len(got) == len(want) and max(diffs) < TOLERANCE, f"trident {got}\nDeepSpeed {want}\ndiffs {diffs}"


def test_three_layouts_read_to_the_same_state():
    """ZeRO-1 and ZeRO-3 on 2 ranks and a 2-stage pipeline trained the same run: same tensors."""
    states = [read_deepspeed(FIXTURES / kind) for kind in KINDS]
    for other in states[1:]:
        for name, master in states[0].params.items():
            torch.testing.assert_close(other.params[name], master, rtol=0, atol=1e-6)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(other.optimizer_state[name][key], states[0].optimizer_state[name][key],
                                           rtol=0, atol=1e-6)
    assert [s.layout["kind"] for s in states] == ["zero1", "zero3", "pipeline"]
    assert all(s.client_state == {"epoch": 1} and s.counters["global_steps"] == 4 for s in states)


@pytest.mark.parametrize("kind,stage", [("zero1", 3), ("zero3", 1), ("pipe", 2)])
def test_import_cli_then_continue_on_two_ranks_under_another_layout(kind, stage, tmp_path, capsys):
    out = tmp_path / "imported"
    assert trident_main(["checkpoint", "import-deepspeed", str(FIXTURES / kind), str(out)]) == 0
    assert (out / "latest").read_text() == "global_step4"
    losses = run_on_ranks(2, continue_training, kind, str(out), stage, False)
    _close(losses[0], expected(kind)["continued_losses"])


def test_load_checkpoint_reads_a_deepspeed_folder_directly():
    losses = run_on_ranks(1, continue_training, "zero3", str(FIXTURES / "zero3"), 0, True)
    _close(losses[0], expected("zero3")["continued_losses"])


def test_bf16_zero2_reads_as_deepspeeds_own_zero_to_fp32():
    """A bf16 ZeRO-2 run (DeepSpeed's bf16_zero_pp_rank_* files): the fp32 masters equal what
    DeepSpeed's zero_to_fp32 made of the same checkpoint (zero_to_fp32_reference.pt)."""
    reference = torch.load(FIXTURES / "zero2_bf16" / "zero_to_fp32_reference.pt", weights_only=True)
    ds = read_deepspeed(FIXTURES / "zero2_bf16")
    assert ds.layout["kind"] == "zero2" and sorted(ds.fp32_state_dict()) == sorted(reference)
    for name, tensor in ds.fp32_state_dict().items():
        assert torch.equal(tensor, reference[name]), name
    assert ds.optimizer_state["0.weight"]["exp_avg"].shape == (16, 8)
    # deepspeed.utils.zero_to_fp32's functions read DeepSpeed folders too
    from trident.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    assert all(torch.equal(v, reference[k]) for k, v in
               get_fp32_state_dict_from_zero_checkpoint(FIXTURES / "zero2_bf16").items())


def test_convert_zero_checkpoint_to_fp32_state_dict(tmp_path):
    from trident.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
    out = convert_zero_checkpoint_to_fp32_state_dict(FIXTURES / "zero3", tmp_path / "model.bin")
    state = torch.load(out, weights_only=True)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model.load_state_dict(state)
    torch.testing.assert_close(model[0].weight, read_deepspeed(FIXTURES / "zero1").params["0.weight"])


# -- bad input: one clear error each, nothing written -----------------------------------------------

def _copy_fixture(kind: str, tmp_path: Path) -> Path:
    dst = tmp_path / kind
    shutil.copytree(FIXTURES / kind, dst)
    return dst


def _refused(src: Path, tmp_path: Path, *words: str) -> None:
    out = tmp_path / "out"
    with pytest.raises(CheckpointError) as info:
        import_deepspeed(src, out)
    text = str(info.value)
    assert all(w in text for w in words), text
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_missing_shard(tmp_path):
    src = _copy_fixture("zero1", tmp_path)
    (src / "global_step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    _refused(src, tmp_path, "zero_pp_rank_1_mp_rank_00_optim_states.pt", "missing")


def test_missing_zero3_model_shard(tmp_path):
    src = _copy_fixture("zero3", tmp_path)
    (src / "global_step4" / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    _refused(src, tmp_path, "incomplete")


def test_truncated_pickle(tmp_path):
    src = _copy_fixture("zero3", tmp_path)
    shard = src / "global_step4" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    _refused(src, tmp_path, "zero_pp_rank_0_mp_rank_00_optim_states.pt", "truncated or damaged")


def test_unknown_deepspeed_version_layout(tmp_path):
    src = _copy_fixture("zero1", tmp_path)
    path = src / "global_step4" / "mp_rank_00_model_states.pt"
    states = read_states(path)
    states["ds_version"] = "0.42.0"
    torch.save(states, path)
    _refused(src, tmp_path, "DeepSpeed 0.42.0", "layout")


def read_states(path: Path) -> dict:
    return torch.load(path, weights_only=True, map_location="cpu")  # this file pickles no DeepSpeed class


def test_output_folder_not_empty_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(CheckpointError, match="not an empty folder"):
        import_deepspeed(FIXTURES / "zero1", out)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
