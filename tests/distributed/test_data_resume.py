"""Exact data resume on real gloo ranks: a dp=2 run trains 3 steps with the engine saving a
checkpoint every 2; resuming that checkpoint at dp=2 and at dp=4 hands every rank exactly the
samples (or, with length bucketing, the batches) that came next in the global stream."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import trident
from trident.config.schema import DataConfig
from trident.data.build import build_loader
from trident.data.indexed import write_indexed_dataset
from trident.models.gpt import GPT, GPTConfig
from trident.testing.distributed import cached_mesh, run_on_ranks

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, d_model=16, dropout=0.0)
MICRO = 2
SEED = 7
BUDGET = 48  # tokens per bucketed batch


def _data(prefix: str, bucketing: bool) -> DataConfig:
    return DataConfig(paths=[prefix], num_workers=1, bucketing=bucketing, val_fraction=0.0,
                      max_tokens_per_batch=BUDGET if bucketing else None)


def _engine_and_loader(prefix: str, ckpt: str, bucketing: bool, save_interval: int):
    mesh = cached_mesh()
    config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 0, "seed": SEED,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "checkpoint": {"path": ckpt, "save_interval": save_interval}}
    torch.manual_seed(0)
    engine, *_ = trident.initialize(model=GPT(CFG), config=config, mesh=mesh)
    loader = build_loader(_data(prefix, bucketing), seq_len=CFG.seq_len, vocab_size=CFG.vocab_size,
                          micro_batch_size=MICRO, dp_rank=mesh.dp_rank, dp_size=mesh.dp_size, seed=SEED,
                          paths=[prefix])
    engine.training_dataloader = loader  # what the engine's periodic checkpoints record
    return engine, loader


def train_three_steps(prefix: str, ckpt: str, bucketing: bool) -> list:
    engine, loader = _engine_and_loader(prefix, ckpt, bucketing, save_interval=2)
    seen = []
    for _ in range(3):
        batch = next(loader)
        seen.append(batch["input_ids"].tolist())
        engine.backward(engine(batch["input_ids"], batch["labels"]))
        engine.step()
    loader.close()
    return seen


def save_without_client_state(prefix: str, ckpt: str) -> dict:
    """A user's own `engine.save_checkpoint(dir)` with no client_state still records the position."""
    engine, loader = _engine_and_loader(prefix, ckpt, False, save_interval=0)
    for _ in range(2):
        batch = next(loader)
        engine.backward(engine(batch["input_ids"], batch["labels"]))
        engine.step()
    engine.save_checkpoint(ckpt, tag="manual")
    _, client_state = engine.load_checkpoint(ckpt, tag="manual")
    loader.close()
    return client_state


def test_every_checkpoint_holds_the_data_position(tmp_path, prefix):
    states = run_on_ranks(2, save_without_client_state, prefix, str(tmp_path / "ckpt"))
    assert all(s["sampler"]["cursor"] == 2 * 2 * MICRO for s in states)


def resume_and_read(prefix: str, ckpt: str, bucketing: bool, n: int) -> list:
    engine, loader = _engine_and_loader(prefix, ckpt, bucketing, save_interval=0)
    _, client_state = engine.load_checkpoint(ckpt)
    assert engine.global_steps == 2
    loader.load_state_dict(client_state["sampler"])
    out = [next(loader)["input_ids"].tolist() for _ in range(n)]
    loader.close()
    return out


@pytest.fixture(scope="module")
def prefix(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(3)
    docs = [rng.integers(1, CFG.vocab_size, int(n)).tolist() for n in rng.integers(2, 30, 80)]
    write_indexed_dataset(folder / "corpus", docs, np.uint16)
    return str(folder / "corpus")


def _global_stream(prefix: str, bucketing: bool, n: int) -> list:
    """The serial reference: the first n units (samples, or bucketed batches) of the stream."""
    loader = build_loader(_data(prefix, bucketing).model_copy(update={"num_workers": 0}), seq_len=CFG.seq_len,
                          vocab_size=CFG.vocab_size, micro_batch_size=1, dp_rank=0, dp_size=1, seed=SEED,
                          paths=[prefix])
    units = [next(loader)["input_ids"].tolist() for _ in range(n)]
    return units if bucketing else [u[0] for u in units]


def _expected(stream: list, start: int, dp: int, rank: int, steps: int, bucketing: bool) -> list:
    """What rank `rank` of `dp` reads in its next `steps` micro-steps from global unit `start`."""
    if bucketing:  # one batch per rank per step
        return [stream[start + m * dp + rank] for m in range(steps)]
    return [stream[start + (m * dp + rank) * MICRO:start + (m * dp + rank + 1) * MICRO] for m in range(steps)]


@pytest.mark.parametrize("bucketing", [False, True], ids=["fixed-batches", "token-budget"])
def test_resume_mid_epoch_at_dp2_and_at_dp4(tmp_path, prefix, bucketing):
    ckpt = str(tmp_path / "ckpt")
    stream = _global_stream(prefix, bucketing, 64)
    if not bucketing:
        from trident.data.samples import DocumentCorpus, GPTWindows
        assert 2 * 2 * MICRO < len(GPTWindows(DocumentCorpus(prefix), CFG.seq_len))  # mid-epoch
    ran = run_on_ranks(2, train_three_steps, prefix, ckpt, bucketing)
    for rank in range(2):  # the dp=2 run itself read the global stream in order
        assert ran[rank] == _expected(stream, 0, 2, rank, 3, bucketing)
    start = 2 * 2 * (1 if bucketing else MICRO)  # units consumed by the 2 checkpointed steps

    again = run_on_ranks(2, resume_and_read, prefix, ckpt, bucketing, 3)
    for rank in range(2):
        assert again[rank][0] == ran[rank][2], f"dp=2 rank {rank}: not the batch that came next"
        assert again[rank] == _expected(stream, start, 2, rank, 3, bucketing)

    wider = run_on_ranks(4, resume_and_read, prefix, ckpt, bucketing, 3)
    for rank in range(4):
        assert wider[rank] == _expected(stream, start, 4, rank, 3, bucketing), f"dp=4 rank {rank}"
