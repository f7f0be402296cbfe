"""Whose activation-checkpointing settings a `checkpoint` call uses (no processes): a wrapped
module's own, else the running model's own (`bind`: its forward, a PipelineModule's run_chunk),
else the process-wide ones of `configure`. Counted with `profile`, which adds each call to the
settings object that handled it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trident import checkpointing
from trident.recompute import activation
from trident.pipeline import LayerSpec, PipelineModule


@pytest.fixture(autouse=True)
def fresh_settings():
    checkpointing.reset()
    yield
    checkpointing.reset()


class DirectCaller(nn.Module):
    """A model that calls trident.checkpointing.checkpoint itself (DeepSpeed style)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpointing.checkpoint(self.inner, x)


def step(model: nn.Module) -> None:
    model(torch.randn(2, 4, requires_grad=True)).sum().backward()


def test_direct_calls_use_the_process_wide_settings_without_a_bound_model():
    process = checkpointing.configure(None, profile=True)
    step(DirectCaller())
    assert process.timings["calls"] == 1 and checkpointing.profile_timings()["calls"] == 1


def test_direct_calls_inside_a_bound_model_use_its_settings():
    process = checkpointing.configure(None, profile=True)
    model, own = DirectCaller(), activation.make_settings(profile=True)
    activation.bind(model, own)
    step(model)
    assert own.timings["calls"] == 1 and process.timings["calls"] == 0
    assert checkpointing.profile_timings(model)["calls"] == 1
    checkpointing.checkpoint(model.inner, torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert process.timings["calls"] == 1  # outside the model's forward: the process-wide ones
    activation.bind(model, None)
    step(model)
    assert own.timings["calls"] == 1 and process.timings["calls"] == 2
    assert activation.settings_of(model) is process


def test_two_bound_models_count_their_own_calls():
    first, second = DirectCaller(), DirectCaller()
    mine, theirs = activation.make_settings(profile=True), activation.make_settings(profile=True)
    activation.bind(first, mine)
    activation.bind(second, theirs)
    for _ in range(2):
        step(first)
    step(second)
    assert (mine.timings["calls"], theirs.timings["calls"]) == (2, 1)
    assert not checkpointing.is_configured()


def test_an_exception_in_forward_does_not_leave_the_settings_active():
    model = DirectCaller()
    activation.bind(model, activation.make_settings(profile=True))
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 5))  # wrong width
    assert activation.current_settings() is not activation.settings_of(model)


def test_wrapped_modules_hold_their_own_settings():
    process = checkpointing.configure(None, profile=True)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    own = activation.make_settings(profile=True)
    assert checkpointing.apply_activation_checkpointing(model, [r"0"], settings=own) == ["0"]
    assert checkpointing.apply_activation_checkpointing(model, [r"1"]) == ["1"]
    step(model)
    assert own.timings["calls"] == 1 and process.timings["calls"] == 1
    assert activation.settings_of(model[0]) is own and activation.settings_of(model[1]) is process


def test_pipeline_module_runs_with_its_own_settings():
    process = checkpointing.configure(None, profile=True)
    pipe = PipelineModule([LayerSpec(nn.Linear, 4, 4) for _ in range(4)], num_stages=1,
                          partition_method="uniform", activation_checkpoint_interval=2)
    own = activation.make_settings(profile=True)
    activation.bind(pipe, own)
    pipe.run_chunk(0, torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert own.timings["calls"] == 2 and process.timings["calls"] == 0


def test_configure_still_sets_and_returns_the_process_wide_settings():
    made = checkpointing.configure(None, cpu_checkpointing=True)
    assert checkpointing.is_configured() and activation.settings() is made and made.cpu_checkpointing
    assert activation.make_settings(cpu_checkpointing=False) is not activation.settings()
