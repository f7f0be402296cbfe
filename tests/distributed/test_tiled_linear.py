"""TiledLinear under ZeRO-3 on 2 gloo ranks: the layer's gathered parameters never exceed one
tile (the coordinator's peak of gathered elements, forward and backward), and it trains like
the nn.Linear it was copied from, on one process (fp32, SGD + momentum + active clipping and
AdamW, rtol 1e-5)."""

from __future__ import annotations

import pytest
import torch

import trident
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.parity import assert_losses_close, optimizer_section, torch_optimizer
from trident.zero import TiledLinear
from trident.zero.partition import padded_size

IN, OUT, STEPS, MICRO, WORLD = 24, 18, 6, 4, 2
LR = {"sgd": 0.05, "adamw": 1e-2}
CLIP = 0.05


class Regression(torch.nn.Module):
    """A linear layer (tiled or not) under a squared-error loss; no parameters of its own."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.layer(x), y)


def reference_linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(IN, OUT)


def data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(STEPS * MICRO * WORLD, IN, generator=g)
    return x, torch.randn(STEPS * MICRO * WORLD, OUT, generator=g)


def train_tiled(in_splits: int, out_splits: int, optimizer: str, clip: float):
    mesh = cached_mesh()
    model = Regression(TiledLinear(IN, OUT, in_splits=in_splits, out_splits=out_splits, init_linear=reference_linear()))
    tiles = [t.weight.numel() + (t.bias.numel() if t.bias is not None else 0) for row in model.layer.linears for t in row]
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "optimizer": optimizer_section(optimizer, LR[optimizer]),
           "gradient_clipping": clip, "steps_per_print": 0,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}}
    engine, _, _, _ = trident.initialize(model=model, config=cfg, mesh=mesh)
    x, y = data()
    losses = []
    for step in range(STEPS):
        lo = (step * WORLD + mesh.dp_rank) * MICRO
        engine.backward(engine(x[lo:lo + MICRO], y[lo:lo + MICRO]))
        engine.step()
        losses.append(engine.last_loss)
    coordinator = engine.strategy.coordinator
    assert coordinator._live_numel == coordinator.live_numel()  # the running count behind the peak is right
    return losses, coordinator.peak_numel, max(padded_size(n, WORLD) for n in tiles)


def serial(optimizer: str, clip: float) -> list[float]:
    model = Regression(reference_linear())
    opt = torch_optimizer(optimizer, model.parameters(), LR[optimizer])
    x, y = data()
    losses = []
    for step in range(STEPS):
        lo = step * WORLD * MICRO
        loss = model(x[lo:lo + WORLD * MICRO], y[lo:lo + WORLD * MICRO])
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("in_splits,out_splits", [(1, 1), (2, 3), (4, 1)])
@pytest.mark.parametrize("optimizer,clip", [("sgd", CLIP), ("adamw", 0.0)])
def test_tiled_linear_under_zero3_gathers_one_tile_and_trains_like_linear(in_splits, out_splits, optimizer, clip):
    results = run_on_ranks(WORLD, train_tiled, in_splits, out_splits, optimizer, clip)
    per_rank = [r[0] for r in results]
    assert_losses_close([sum(s) / WORLD for s in zip(*per_rank)], serial(optimizer, clip), rtol=1e-5)
    for _, peak, tile in results:
        assert peak == tile, f"peak gathered elements {peak}, one tile (padded) {tile}"
    whole = padded_size(IN * OUT + OUT, WORLD)
    assert in_splits * out_splits == 1 or results[0][2] < whole
