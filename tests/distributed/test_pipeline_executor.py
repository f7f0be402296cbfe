"""The pipeline executor on gloo ranks: tuples between stages, cached shapes, evaluation, and
failures that stop every rank with the failing stage's error instead of hanging."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import trident
from trident.engine.pipeline_engine import PipelineEngine
from trident.pipeline import LayerSpec, PipelineError, PipelineModule
from trident.testing.distributed import cached_mesh, run_on_ranks

D = 6
LR = 0.05


class Split(nn.Module):
    """x -> (fc(x), number of positive inputs per row): a float and an integer tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.fc(x)), (x > 0).sum(-1)


class Mix(nn.Module):
    """(h, counts) -> (fc(h) scaled by counts, counts)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, counts = pair
        return self.fc(h) * (1 + counts.unsqueeze(-1)) / D, counts


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, 2)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.fc(pair[0])


class Explode(nn.Module):
    """Passes its input through; raises on the `plan = (stage, n)` n-th call on that stage."""

    plan: tuple[int, int] | None = None
    calls = 0

    def forward(self, x):
        Explode.calls += 1
        stage = dist.get_rank() // (dist.get_world_size() // 2) if dist.is_initialized() else 0
        if Explode.plan == (stage, Explode.calls):
            raise ValueError(f"boom in call {Explode.calls}")
        return x


PARTITION = "type:Split|Mix|Head"  # two of them per stage, one Explode each


def layers() -> list:
    return [LayerSpec(Split), LayerSpec(Explode), LayerSpec(Mix), LayerSpec(Mix), LayerSpec(Explode),
            LayerSpec(Head)]


def batches(steps: int, micro: int, micro_batches: int, seed: int = 0) -> list[list[tuple]]:
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(micro, D, generator=g), torch.randn(micro, 2, generator=g))
             for _ in range(micro_batches)] for _ in range(steps)]


def engine_for(module: PipelineModule, mesh, micro: int, micro_batches: int, schedule: str) -> PipelineEngine:
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": micro_batches,
              "optimizer": {"type": "SGD", "params": {"lr": LR}}, "steps_per_print": 0,
              "pipeline": {"stages": mesh.pp_size, "schedule": schedule, "partition_method": PARTITION}}
    e, *_ = trident.initialize(model=module, config=config, mesh=mesh)
    assert isinstance(e, PipelineEngine)
    return e


def staged(plan: tuple[int, int] | None = None, pp: int = 2) -> tuple[PipelineModule, object]:
    """This rank's stage, with the weights of the seeded single-stage model."""
    Explode.plan, Explode.calls = plan, 0
    mesh = cached_mesh(pp=pp)
    torch.manual_seed(0)
    full = PipelineModule(layers(), num_stages=1, partition_method=PARTITION).state_dict()
    module = PipelineModule(layers(), num_stages=pp, loss_fn=F.mse_loss, partition_method=PARTITION,
                            stage_id=mesh.pp_rank)
    module.load_state_dict({k: full[k] for k in module.state_dict()})
    return module, mesh


def serial_losses(steps: int, micro: int, micro_batches: int) -> tuple[list[float], list[float]]:
    """Training losses, and the loss on a held-out batch after each step, of one process."""
    torch.manual_seed(0)
    model = PipelineModule(layers(), num_stages=1, loss_fn=F.mse_loss, partition_method=PARTITION)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    held_out = batches(1, micro, micro_batches, seed=9)[0]
    train, evals = [], []
    for batch in batches(steps, micro, micro_batches):
        loss = sum(F.mse_loss(model(x), y) for x, y in batch) / micro_batches
        loss.backward()
        opt.step()
        opt.zero_grad()
        train.append(loss.item())
        with torch.no_grad():
            evals.append(sum(F.mse_loss(model(x), y).item() for x, y in held_out) / micro_batches)
    return train, evals


def train_tuples(schedule: str) -> tuple[list[float], list[float]]:
    module, mesh = staged()
    engine = engine_for(module, mesh, micro=3, micro_batches=4, schedule=schedule)
    held_out = batches(1, 3, 4, seed=9)[0]
    train, evals = [], []
    for batch in batches(4, 3, 4):
        train.append(float(engine.train_batch(iter(batch))))
        evals.append(float(engine.eval_batch(iter(held_out))))
    return train, evals


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_tuples_with_integer_tensors_cross_stages(schedule):
    """Stage 0 sends (float, int64) pairs; only the float carries a gradient back."""
    ref_train, ref_eval = serial_losses(4, 3, 4)
    for train, evals in run_on_ranks(2, train_tuples, schedule):
        assert train == pytest.approx(ref_train, rel=1e-5)
        assert evals == pytest.approx(ref_eval, rel=1e-5)


def fail(plan: tuple[int, int] | None, pp: int = 2, data_on_last: bool = True) -> str:
    """Train one batch that fails somewhere; return the error every rank sees."""
    module, mesh = staged(plan, pp=pp)
    engine = engine_for(module, mesh, micro=2, micro_batches=4, schedule="1f1b")
    batch = batches(1, 2, 4)[0]
    needs_data = engine.is_first_stage() or (engine.is_last_stage() and data_on_last)
    with pytest.raises(PipelineError) as info:
        engine.train_batch(iter(batch) if needs_data else None)
    assert engine.global_steps == 0  # nobody stepped
    return str(info.value)


def test_a_failing_stage_stops_every_rank_with_its_error():
    for message in run_on_ranks(2, fail, (1, 3)):
        assert "train_batch: pipeline stage 1 (global rank 1) raised ValueError: boom in call 3" in message
    # before any activation was sent: the peer gets placeholder shapes and fails too, later
    for message in run_on_ranks(2, fail, (0, 1)):
        assert message.startswith("train_batch: pipeline stage 0 (global rank 0) raised ValueError: boom")
    for message in run_on_ranks(2, fail, None, 2, False):
        assert "stage 1 (global rank 1) raised ValueError: pipeline stage 1 reads micro-batches but " \
               "data_iter is None" in message
    train, _ = run_on_ranks(2, train_tuples, "1f1b")[0]  # the ranks are still in step
    assert train == pytest.approx(serial_losses(4, 3, 4)[0], rel=1e-5)


def test_a_failure_on_one_data_parallel_replica_stops_all_of_them():
    messages = run_on_ranks(4, fail, (0, 2), 2)  # pp 2 x dp 2: ranks 0 and 1 are stage 0
    assert len(set(m.splitlines()[0] for m in messages)) == 1
    assert "raised ValueError: boom in call 2" in messages[0]


def change_shapes() -> tuple[str, float]:
    module, mesh = staged()
    engine = engine_for(module, mesh, micro=2, micro_batches=2, schedule="gpipe")
    engine.train_batch(iter(batches(1, 2, 2)[0]))
    with pytest.raises(PipelineError) as info:
        engine.train_batch(iter(batches(1, 3, 2)[0]))
    engine.reset_activation_shape()
    return str(info.value), float(engine.train_batch(iter(batches(1, 3, 2)[0])))


def test_shapes_are_cached_and_a_change_needs_a_reset():
    for message, loss in run_on_ranks(2, change_shapes):
        assert "pipeline stage 0 (global rank 0) raised ValueError: pipeline stage 0 chunk 0: " \
               "micro-batch 0's output is float32[3, 6], int64[3]" in message
        assert "engine.reset_activation_shape() on every rank" in message
        assert loss > 0
