"""Engine guards: non-finite gradients named by parameter, periodic checkpoints with
keep_last, and auto-resume."""

from __future__ import annotations

import pytest
import torch

import trident
from trident.models.toy import TinyMLP
from trident.testing.distributed import RankFailure, cached_mesh, run_on_ranks


def cfg(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 0,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **extra}


def poisoned_step(stage: int, on_nonfinite: str):
    mesh = cached_mesh()
    torch.manual_seed(0)
    model = TinyMLP()
    engine, *_ = trident.initialize(model=model, config=cfg(numerics={"on_nonfinite": on_nonfinite},
                                                            zero_optimization={"stage": stage}), mesh=mesh)
    names = [n for n, _ in engine.module.named_parameters()]
    target = dict(engine.module.named_parameters())[names[-1]]
    if mesh.dp_rank == 1:  # only rank 1 sees the NaN
        target.register_hook(lambda g: torch.full_like(g, float("nan")))
    engine.backward(engine(torch.randn(4, 16), torch.randn(4, 16)))
    engine.step()
    return engine.skipped_steps, names[-1]


@pytest.mark.parametrize("stage", [0, 2])
def test_nonfinite_gradient_is_named_and_stops_every_rank(stage):
    with pytest.raises(RankFailure) as info:
        run_on_ranks(2, poisoned_step, stage, "stop")
    message = str(info.value)
    assert "holds NaN or inf" in message and "numerics.on_nonfinite" in message
    name = run_on_ranks(2, poisoned_step, stage, "skip")[0][1]
    assert f"the gradient of {name}" in message


def test_nonfinite_gradient_skip_skips_on_every_rank():
    assert [r[0] for r in run_on_ranks(2, poisoned_step, 0, "skip")] == [1, 1]


def periodic(path: str, steps: int, resume: bool):
    mesh = cached_mesh()
    torch.manual_seed(0)
    engine, *_ = trident.initialize(model=TinyMLP(), config=cfg(
        checkpoint={"path": path, "save_interval": 2, "keep_last": 2, "auto_resume": resume}), mesh=mesh)
    start = engine.global_steps
    g = torch.Generator().manual_seed(4)
    data = torch.randn(steps * 8, 32, generator=g)
    losses = []
    for step in range(start, steps):
        batch = data[step * 8 + mesh.dp_rank * 4:step * 8 + mesh.dp_rank * 4 + 4]
        engine.backward(engine(batch[:, :16], batch[:, 16:]))
        engine.step()
        losses.append(engine.last_loss)
    return start, losses


def test_periodic_checkpoints_keep_last_and_auto_resume(tmp_path):
    path = str(tmp_path / "ckpt")
    (start, full), _ = run_on_ranks(2, periodic, path, 7, False)
    assert start == 0
    tags = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if not p.name.startswith("."))
    assert tags == ["global_step4", "global_step6", "latest"]
    (start, rest), _ = run_on_ranks(2, periodic, path, 7, True)
    assert start == 6 and rest == pytest.approx(full[6:], rel=1e-6)
