"""`trident.initialize` moves a model built on the CPU to the engine's device, as DeepSpeed does.

CI has no GPU: what is checked here is which tensors move (`tensors_to_place`: CPU tensors,
not zero.Init's shards, nothing under ZeRO-3 with offload_param) and that nothing moves when the
engine's device is the CPU. The move itself is `t.data = t.data.to(device)`, `Module.to`'s."""

from __future__ import annotations

import torch
from torch import nn

from trident.config import load_config
from trident.engine.build import place_on_device, tensors_to_place


def _model():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    model.register_buffer("steps", torch.zeros(()))
    return model


def test_cpu_parameters_and_buffers_are_placed():
    model = _model()
    placed = tensors_to_place(model)
    assert [id(t) for t in placed] == [id(t) for t in (*model.parameters(), *model.buffers())]


def test_zero_init_shards_meta_tensors_and_offloaded_zero3_stay_put():
    model = _model()
    model[0].weight._trident_shard = True  # what zero.Init leaves on the shards it placed
    model[2].weight = nn.Parameter(torch.empty(2, 4, device="meta"))  # loaded later
    placed = {id(t) for t in tensors_to_place(model)}
    assert id(model[0].weight) not in placed and id(model[2].weight) not in placed and id(model[0].bias) in placed
    cfg = load_config({"train_micro_batch_size_per_gpu": 1,
                       "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
    assert tensors_to_place(_model(), cfg) == []


def test_nothing_moves_on_the_cpu():
    model = _model()
    assert place_on_device(model, torch.device("cpu")) == 0
