"""Pipeline engines save and resume: each stage writes its own model file, and a resumed run
continues with the losses of an uninterrupted one (tied embeddings included)."""

from __future__ import annotations

import pytest

import trident
from trident.models.gpt import GPTConfig
from trident.models.gpt_pipe import gpt_pipe, load_gpt_state_dict
from trident.testing.distributed import cached_mesh, run_on_ranks
from tests.parity.test_pp_equivalence import LR, MICRO, MODEL, make_gpt, make_tokens

M = 2  # micro-batches per step


def run(root: str, steps: int, save_at: int | None, resume: bool, zero_stage: int):
    mesh = cached_mesh(pp=2)
    cfg = GPTConfig(**MODEL)
    pipe = gpt_pipe(cfg, 2, partition_method="uniform", stage_id=mesh.pp_rank)
    load_gpt_state_dict(pipe, make_gpt().state_dict(), cfg)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": M, "steps_per_print": 0,
              "optimizer": {"type": "AdamW", "params": {"lr": LR}}, "zero_optimization": {"stage": zero_stage},
              "pipeline": {"stages": 2, "schedule": "1f1b", "partition_method": "uniform"}}
    engine, *_ = trident.initialize(model=pipe, config=config, mesh=mesh)
    if resume:
        engine.load_checkpoint(root)
    data = make_tokens(MICRO * M * mesh.dp_size)
    losses = []
    for step in range(engine.global_steps, steps):
        mine = data[step * MICRO * M:(step + 1) * MICRO * M]
        micro = [(mine[k:k + MICRO, :-1], mine[k:k + MICRO, 1:]) for k in range(0, len(mine), MICRO)]
        losses.append(float(engine.train_batch(iter(micro))))
        if engine.global_steps == save_at:
            engine.save_checkpoint(root)
    return losses


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_pipeline_checkpoint_resumes_exactly(zero_stage, tmp_path):
    root = str(tmp_path / "ckpt")
    full = run_on_ranks(2, run, root, 6, 3, False, zero_stage)
    again = run_on_ranks(2, run, root, 6, None, True, zero_stage)
    assert again[0] == pytest.approx(full[0][3:], rel=1e-6)
    files = sorted(p.name for p in (tmp_path / "ckpt" / "global_step3").iterdir())
    assert "model_pp0_tp0.safetensors" in files and "model_pp1_tp0.safetensors" in files
