"""Sync parameter servers train to the same losses and weights as one process (fp32, rtol 1e-5).

The serial reference is plain PyTorch in the test process: one forward over the whole global
batch per step, AdamW, trident's WarmupLR, torch's clip_grad_norm_. The parameter-server run
has S server ranks and W worker ranks; the workers run the very loop a data-parallel script
runs (`train_loop`), each on its own micro-batches of the same global batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import trident
from trident.config import load_config
from trident.models.gpt import GPT, GPTConfig
from trident.optim.schedulers import build_scheduler
from trident.parameter_server import serve
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.parity import assert_losses_close, assert_state_close

STEPS = 12
# No biases, as in the data-parallel parity test: the key bias's gradient is pure rounding noise.
MODEL = dict(vocab_size=61, seq_len=16, n_layer=2, n_head=2, d_model=32, dropout=0.0, bias=False)
LR = 3e-3
SCHEDULE = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 5}}


def make_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**MODEL))


def make_tokens(global_batch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, MODEL["vocab_size"], (STEPS * global_batch, MODEL["seq_len"] + 1), generator=g)


def config(servers: int, micro: int, gas: int, clip: float, placement: str = "balanced") -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "scheduler": SCHEDULE,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": 0, "reduce_bucket_size": 3000},  # several buckets per shard
        "parameter_server": {"servers": servers, "mode": "sync", "placement": placement},
        "steps_per_print": 0,
    }


def train_loop(engine, micro: int, gas: int) -> tuple[list[float], list[float]]:
    """A data-parallel training script's loop, verbatim: it runs unchanged on either architecture."""
    rank, dp = engine.dp_rank, engine.dp_world_size
    global_batch = micro * gas * dp
    data = make_tokens(global_batch)
    losses, lrs = [], []
    for step in range(STEPS):
        for k in range(gas):
            start = step * global_batch + (rank * gas + k) * micro
            batch = data[start:start + micro]
            loss = engine(batch[:, :-1], batch[:, 1:])
            engine.backward(loss)
            engine.step()
        losses.append(engine.last_loss)
        lrs.append(engine.get_lr()[0])
    assert engine.global_steps == STEPS
    return losses, lrs


def serial_reference(global_batch: int, clip: float):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    schedule = build_scheduler(load_config({"train_micro_batch_size_per_gpu": 1, "scheduler": SCHEDULE}).scheduler,
                               opt)
    data = make_tokens(global_batch)
    losses, lrs = [], []
    for step in range(STEPS):
        batch = data[step * global_batch:(step + 1) * global_batch]
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        schedule.step()
        opt.zero_grad()
        losses.append(loss.item())
        lrs.append(opt.param_groups[0]["lr"])
    return losses, lrs, {k: v.clone() for k, v in model.state_dict().items()}


def run_ps(servers: int, micro: int, gas: int, clip: float, placement: str):
    """Every rank: the first `servers` serve, the rest train through trident.initialize."""
    mesh = cached_mesh()
    cfg = config(servers, micro, gas, clip, placement)
    if dist.get_rank() < servers:
        result = serve(cfg, make_model(), mesh=mesh)
        return {"role": "server", "params": result.parameters, "version": result.version,
                "steps": result.worker_steps, "records": len(result.records)}
    engine, _, _, _ = trident.initialize(model=make_model(), config=cfg, mesh=mesh)
    assert engine.dp_world_size == dist.get_world_size() - servers
    assert engine.dp_rank == dist.get_rank() - servers
    losses, lrs = train_loop(engine, micro, gas)
    weights = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    engine.close()
    return {"role": "worker", "losses": losses, "lrs": lrs, "weights": weights, "bytes": engine.comm_bytes()}


@pytest.mark.parametrize("servers,workers,micro,gas,clip,placement", [
    (1, 2, 2, 2, 0.0, "balanced"),       # accumulation; CentralStorage-style single server
    (2, 2, 4, 1, 0.05, "balanced"),      # clipping on most steps: servers exchange squared norms
    (1, 3, 2, 1, 0.0, "round_robin"),
    (2, 3, 2, 2, 0.05, "round_robin"),
])
def test_sync_ps_matches_serial(servers, workers, micro, gas, clip, placement):
    ref_losses, ref_lrs, ref_weights = serial_reference(micro * gas * workers, clip)
    results = run_on_ranks(servers + workers, run_ps, servers, micro, gas, clip, placement)
    server_side = [r for r in results if r["role"] == "server"]
    worker_side = [r for r in results if r["role"] == "worker"]
    per_step = zip(*(r["losses"] for r in worker_side))
    assert_losses_close([sum(s) / len(s) for s in per_step], ref_losses, rtol=1e-5)
    for r in worker_side:
        assert r["lrs"] == pytest.approx(ref_lrs, rel=1e-12)
        assert_state_close(r["weights"], ref_weights, rtol=1e-5)
    held = {}
    for r in server_side:
        assert r["version"] == STEPS and r["records"] == STEPS * workers
        assert r["steps"] == {w: STEPS for w in range(workers)}
        held.update(r["params"])
    # tied embeddings appear once among the parameters, twice in the state dict
    expected = {k: v for k, v in ref_weights.items() if k in held}
    assert len(held) == len(dict(make_model().named_parameters()))
    assert_state_close(held, expected, rtol=1e-5)
