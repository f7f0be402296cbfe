"""The batches `initialize(training_data=...)` hands out are DeepSpeed's (issue 32, item 3): torch's
DistributedSampler with its default seed 0 (the config's `seed` when it sets one), micro-batches of
train_micro_batch_size_per_gpu, `dataloader_drop_last`, every pass the same epoch (DeepSpeed never
calls set_epoch); the pipeline engine's loader in order, repeated."""

from __future__ import annotations

import torch

import trident
from trident.data.repeating_loader import RepeatingLoader
from trident.testing.distributed import cached_mesh, run_on_ranks

N, MICRO = 22, 4


def dataset():
    return torch.utils.data.TensorDataset(torch.arange(N).float().unsqueeze(1), torch.arange(N))


def deepspeed_order(rank: int, world: int, seed: int = 0, shuffle: bool = True, drop_last: bool = False) -> list:
    """What DeepSpeed's DeepSpeedDataLoader yields: torch's own sampler and DataLoader."""
    sampler = torch.utils.data.DistributedSampler(dataset(), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=MICRO, sampler=sampler, drop_last=drop_last)
    return [b[1].tolist() for b in loader]


def loader_batches(extra: dict, pipeline: bool = False):
    mesh = cached_mesh()
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 0, **extra,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    if pipeline:
        model = trident.PipelineModule([torch.nn.Linear(1, 2)], num_stages=1, loss_fn=torch.nn.CrossEntropyLoss())
    else:
        model = torch.nn.Linear(1, 2)
    engine, _, loader, _ = trident.initialize(model=model, config=cfg, training_data=dataset(), mesh=mesh)
    if pipeline:
        return [next(loader)[1].tolist() for _ in range(8)], isinstance(loader, RepeatingLoader)
    passes = [[b[1].tolist() for b in loader] for _ in range(2)]
    io = [b[1].tolist() for b in engine.deepspeed_io(dataset(), route="eval")]
    return passes, io


def test_initialize_loader_is_deepspeeds():
    for rank, (passes, io) in enumerate(run_on_ranks(2, loader_batches, {})):
        assert passes[0] == passes[1] == deepspeed_order(rank, 2)  # seed 0, and no reshuffle between passes
        assert io == deepspeed_order(rank, 2, shuffle=False)       # deepspeed_io's eval route: in order


def test_config_seed_and_drop_last():
    for rank, (passes, _) in enumerate(run_on_ranks(2, loader_batches, {"seed": 7, "dataloader_drop_last": True})):
        assert passes[0] == deepspeed_order(rank, 2, seed=7, drop_last=True)
        assert all(len(b) == MICRO for b in passes[0])


def test_pipeline_engine_loader_is_in_order_and_repeats():
    for rank, (batches, repeating) in enumerate(run_on_ranks(2, loader_batches, {}, True)):
        order = deepspeed_order(rank, 2, shuffle=False)
        assert repeating and batches == (order * 3)[:8]
