"""A loss of one's own, token-weighted: `engine.backward(loss, num_tokens=n)` and
`engine.tokens_in_step` (`data.loss_normalization`), and the errors when a count is missing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trident
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.parity import assert_losses_close, assert_state_close

ROWS, WIDTH, STEPS, LR, CLIP = 8, 6, 3, 0.5, 0.05


class MaskedRegression(nn.Module):
    """Squared error averaged over the entries a mask keeps: a loss whose count varies by row."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, y, mask):
        return ((self.fc(x) - y) ** 2)[mask].mean()


def data():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(STEPS, ROWS, WIDTH, generator=g), torch.randn(STEPS, ROWS, WIDTH, generator=g)
    mask = torch.rand(STEPS, ROWS, WIDTH, generator=g) < 0.9
    mask[:, ROWS // 2:, 2:] = False  # the second half of every batch counts far fewer entries
    return x, y, mask


def serial():
    model = MaskedRegression()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    x, y, mask = data()
    losses = []
    for s in range(STEPS):
        loss = model(x[s], y[s], mask[s])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def config(micro: int, gas: int, mode="tokens") -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "steps_per_print": 0,
            "gradient_clipping": CLIP, "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
            "data": {"loss_normalization": mode}}


def train(micro: int, gas: int):
    mesh = cached_mesh()
    engine, *_ = trident.initialize(model=MaskedRegression(), config=config(micro, gas), mesh=mesh)
    x, y, mask = data()
    losses, tokens = [], []
    per = ROWS // mesh.dp_size
    for s in range(STEPS):
        rows = slice(mesh.dp_rank * per, (mesh.dp_rank + 1) * per)
        xs, ys, ms = x[s][rows], y[s][rows], mask[s][rows]
        for k in range(gas):
            part = slice(k * micro, (k + 1) * micro)
            engine.backward(engine(xs[part], ys[part], ms[part]), num_tokens=ms[part].sum())
            engine.step()
        losses.append(engine.last_loss)
        tokens.append(engine.tokens_in_step)
    return losses, tokens, {k: v.clone() for k, v in engine.module.state_dict().items()}


@pytest.mark.parametrize("world,micro,gas", [(1, 4, 2), (2, 4, 1), (2, 2, 2)])
def test_num_tokens_weighs_a_loss_of_ones_own(world, micro, gas):
    ref_losses, ref_weights = serial()
    counts = [int(m.sum()) for m in data()[2]]
    for losses, tokens, weights in run_on_ranks(world, train, micro, gas):
        assert_losses_close(losses, ref_losses, rtol=1e-6)
        assert tokens == counts
        assert_state_close(weights, ref_weights, rtol=1e-6)


def refused(mode: str, num_tokens_first: bool) -> str:
    mesh = cached_mesh()
    engine, *_ = trident.initialize(model=MaskedRegression(), config=config(2, 2, mode), mesh=mesh)
    x, y, mask = data()
    try:
        loss = engine(x[0][:2], y[0][:2], mask[0][:2])
        engine.backward(loss, num_tokens=mask[0][:2].sum() if num_tokens_first else None)
        engine.step()
        engine.backward(engine(x[0][2:4], y[0][2:4], mask[0][2:4]))
    except ValueError as err:
        return str(err)
    return "accepted"


def test_a_missing_count_is_an_error_that_says_what_to_do():
    message = run_on_ranks(1, refused, "tokens", False)[0]
    assert "comes with no token count" in message and "num_tokens=n" in message and "micro_batch" in message
    message = run_on_ranks(1, refused, None, True)[0]  # counted, then not, in one window
    assert "mixes micro-batches with and without a token count" in message
    message = run_on_ranks(1, refused, "micro_batch", True)[0]
    assert "num_tokens" in message and "\"micro_batch\"" in message
