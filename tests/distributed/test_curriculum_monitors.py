"""The engine with DeepSpeed's `curriculum_learning` and every file-backed monitor on 2 gloo ranks:
each step's inputs reach the model cut to DeepSpeed's length for that step (a model that takes
`curriculum_seqlen` gets the number instead), a resumed run continues the schedule from the
checkpoint, the pipeline engine cuts its micro-batches too, and the CSV, wandb (offline) and
MLflow (file store) monitors hold the same scalars, written by rank 0 only."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import trident
from trident.models.gpt import GPT, GPTConfig
from trident.models.gpt_pipe import gpt_pipe
from trident.testing.distributed import cached_mesh, run_on_ranks
from tests.unit.test_curriculum import deepspeed_run
from tests.unit.test_monitor_backends import wandb_history

SEQ, VOCAB, STEPS = 32, 61, 6
CURRICULUM = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8, "max_difficulty": SEQ,
              "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": STEPS, "difficulty_step": 8}}
EXPECTED = deepspeed_run(CURRICULUM, STEPS)  # [8, 16, 16, 24, 24, 32]
QUIET = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_ERROR_REPORTING": "false"}


def tokens(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)


def curriculum_run(out: str, steps: int, resume: bool, monitors: bool) -> dict:
    """Train a tiny GPT; returns the sequence length each forward saw and the engine's answers."""
    mesh = cached_mesh()
    os.environ.update(QUIET, WANDB_DIR=out)  # the pool's processes are reused: only offline settings
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=1, n_head=2, d_model=16))
    seen: list[int] = []
    model.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[1]))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "curriculum_learning": CURRICULUM,
              "checkpoint": {"path": os.path.join(out, "ckpt"), "save_interval": 3}}
    if monitors:
        config.update(csv_monitor={"enabled": True, "output_path": out, "job_name": "csv"},
                      wandb={"enabled": True, "project": "curriculum", "group": "g"},
                      mlflow={"enabled": True, "tracking_uri": os.path.join(out, "mlruns"), "run_name": "r"})
    engine, *_ = trident.initialize(model=model, config=config, mesh=mesh)
    if resume:
        engine.load_checkpoint(os.path.join(out, "ckpt"))
    first = engine.global_steps
    planned = []
    for step in range(first, steps):
        planned.append(engine.curriculum_seqlen())
        for micro in range(2):
            batch = tokens(2 * step + micro, mesh.dp_rank)
            engine.backward(engine(batch[:, :-1], batch[:, 1:]))
            engine.step()
    engine.eval()
    full = engine(tokens(99, 0)[:, :-1]).shape[1]  # evaluation: not cut
    mlflow_run = next((w.run_id for w in engine.monitors.writers if hasattr(w, "run_id")), None)
    engine.destroy()
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()  # wandb reads WANDB_DIR once per process; the pool's processes live on
    return {"seen": seen[:-1], "planned": planned, "first": first, "eval_len": full, "mlflow_run": mlflow_run,
            "enabled": engine.curriculum_enabled_legacy(), "params": engine.curriculum_params_legacy()}


def test_each_step_trains_on_deepspeeds_length_and_the_monitors_hold_the_scalars(tmp_path, monkeypatch):
    import wandb  # noqa: F401  (the dev extra installs it: missing is a failure, not a skip)
    import mlflow  # noqa: F401  (the dev extra installs it: missing is a failure, not a skip)
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads its file store only when asked to

    out = str(tmp_path)
    r0, r1 = run_on_ranks(2, curriculum_run, out, STEPS, False, True)
    assert r0["planned"] == r1["planned"] == EXPECTED
    assert r0["seen"] == r1["seen"] == [n for n in EXPECTED for _ in range(2)]  # both micro-batches of a step
    assert r0["eval_len"] == SEQ and r0["enabled"] is True
    assert r0["params"]["schedule_type"] == "fixed_linear" and "enabled" not in r0["params"]

    # CSV: DeepSpeed's per-step scalars, the curriculum's length, and at steps_per_print the rest
    with open(tmp_path / "csv" / "metrics.csv") as f:
        header, *rows = [line.split(",") for line in f.read().splitlines()]
    rows = [dict(zip(header, r)) for r in rows]
    samples = [8 * s for s in range(1, STEPS + 1)]  # global batch 2 x 2 x 2 ranks
    assert [int(r["step"]) for r in rows] == samples
    assert [float(r["Train/Samples/curriculum_seqlen"]) for r in rows] == EXPECTED
    assert all(float(r["Train/Samples/train_loss"]) > 0 for r in rows)
    every_print = ("Train/Samples/grad_norm", "Train/Samples/samples_per_sec", "Train/Samples/tokens_per_sec",
                   "Train/Samples/memory_GiB", "Train/Samples/peak_memory_GiB")
    for r, step in zip(rows, range(1, STEPS + 1)):
        assert all((r[k] != "") == (step % 2 == 0) for k in every_print), (step, r)
    assert all(float(rows[i]["Train/Samples/peak_memory_GiB"]) > 0.01 for i in (1, 3, 5))

    # wandb, read back with wandb's own reader: one run (rank 0's), the same rows
    history = wandb_history(tmp_path, project="curriculum", group="g")
    assert [h["_step"] for h in history] == samples
    assert [h["Train/Samples/curriculum_seqlen"] for h in history] == EXPECTED
    assert [h["Train/Samples/train_loss"] for h in history] == pytest.approx(
        [float(r["Train/Samples/train_loss"]) for r in rows])
    assert all("Train/Samples/tokens_per_sec" in history[i] for i in (1, 3, 5))

    # MLflow's file store, read with MlflowClient
    client = MlflowClient((tmp_path / "mlruns").as_uri())
    assert r1["mlflow_run"] is None  # rank 1 writes nothing
    seqlen = client.get_metric_history(r0["mlflow_run"], "Train/Samples/curriculum_seqlen")
    assert [(m.step, m.value) for m in seqlen] == list(zip(samples, map(float, EXPECTED)))
    norms = client.get_metric_history(r0["mlflow_run"], "Train/Samples/grad_norm")
    assert [m.step for m in norms] == samples[1::2]


def test_a_resumed_run_continues_the_schedule(tmp_path):
    out = str(tmp_path)
    run_on_ranks(2, curriculum_run, out, 3, False, False)  # saves at step 3
    r0, _ = run_on_ranks(2, curriculum_run, out, STEPS, True, False)
    assert r0["first"] == 3
    assert r0["planned"] == EXPECTED[3:] and r0["seen"] == [n for n in EXPECTED[3:] for _ in range(2)]
    saved = torch.load(tmp_path / "ckpt" / "global_step3" / "training_state.pt", weights_only=True)
    assert saved["curriculum"]["state"]["current_difficulty"] == EXPECTED[2]


class TakesSeqlen(torch.nn.Module):
    """A Megatron-style model: cuts its own inputs to `curriculum_seqlen` (DeepSpeed's contract)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.lengths: list[int | None] = []

    def forward(self, ids, labels, curriculum_seqlen=None):
        self.lengths.append(curriculum_seqlen)
        n = curriculum_seqlen or ids.shape[1]
        return self.emb(ids[:, :n]).float().pow(2).mean() + 0 * labels[:, :n].float().sum()


def seqlen_argument_run() -> list:
    mesh = cached_mesh()
    model = TakesSeqlen()
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0, "curriculum_learning": CURRICULUM,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = trident.initialize(model=model, config=config, mesh=mesh)
    for step in range(4):
        batch = tokens(step, mesh.dp_rank)
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))
        engine.step()
    return model.lengths


def test_a_model_taking_curriculum_seqlen_gets_the_number():
    lengths, _ = run_on_ranks(2, seqlen_argument_run)
    assert lengths == EXPECTED[:4]


def pipeline_run() -> list[int]:
    mesh = cached_mesh(pp=2)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=2, d_model=16)
    pipe = gpt_pipe(cfg, 2, partition_method="uniform", stage_id=mesh.pp_rank)
    seen: list[int] = []
    if mesh.pp_rank == 0:
        first = next(m for m in pipe.modules() if isinstance(m, torch.nn.Embedding))
        first.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[1]))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 0,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "curriculum_learning": CURRICULUM,
              "pipeline": {"stages": 2, "schedule": "1f1b", "partition_method": "uniform"}}
    engine, *_ = trident.initialize(model=pipe, config=config, mesh=mesh)
    for step in range(STEPS):
        micro = [tokens(2 * step + k, 0) for k in range(2)]
        engine.train_batch(iter([(b[:, :-1], b[:, 1:]) for b in micro]))
    return seen


def test_the_pipeline_engine_cuts_its_micro_batches():
    seen, _ = run_on_ranks(2, pipeline_run)
    assert seen == [n for n in EXPECTED for _ in range(2)]
