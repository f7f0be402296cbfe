"""Sync parameter servers train to the same losses and weights as one process (fp32, rtol 1e-5).

The serial reference is plain PyTorch in the test process: one forward over the whole global
batch per step, AdamW, trident's WarmupLR, torch's clip_grad_norm_. The parameter-server run
has S server ranks and W worker ranks; the workers run the very loop a data-parallel script
runs (`train_loop`), each on its own micro-batches of the same global batch.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import trident
from trident.config import load_config
from trident.models.gpt import GPT, GPTConfig
from trident.optim.schedulers import build_scheduler
from trident.parameter_server import serve
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.parity import (SerialRun, assert_losses_close, assert_norms_close, assert_state_close,
                                    optimizer_section, precision_sections, train_serial)

STEPS = 12
# No biases, as in the data-parallel parity test: the key bias's gradient is pure rounding noise.
MODEL = dict(vocab_size=61, seq_len=16, n_layer=2, n_head=2, d_model=32, dropout=0.0, bias=False)
LR = 3e-3
OPT_LR = {"adamw": LR, "sgd": 0.5}
SGD_CLIP = 0.05  # below the gradient norm on every step of the SGD case
SCHEDULE = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 5}}


def make_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**MODEL))


def make_tokens(global_batch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, MODEL["vocab_size"], (STEPS * global_batch, MODEL["seq_len"] + 1), generator=g)


def config(servers: int, micro: int, gas: int, clip: float, placement: str = "balanced",
           optimizer: str = "adamw", precision: str = "fp32") -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "optimizer": optimizer_section(optimizer, OPT_LR[optimizer]),
        "scheduler": SCHEDULE,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": 0, "reduce_bucket_size": 3000},  # several buckets per shard
        "parameter_server": {"servers": servers, "mode": "sync", "placement": placement},
        "steps_per_print": 0,
        **precision_sections(precision),
    }


def train_loop(engine, micro: int, gas: int) -> tuple[list[float], list[float], list[float | None]]:
    """A data-parallel training script's loop, verbatim: it runs unchanged on either architecture."""
    rank, dp = engine.dp_rank, engine.dp_world_size
    global_batch = micro * gas * dp
    data = make_tokens(global_batch)
    losses, lrs, norms = [], [], []
    for step in range(STEPS):
        for k in range(gas):
            start = step * global_batch + (rank * gas + k) * micro
            batch = data[start:start + micro]
            loss = engine(batch[:, :-1], batch[:, 1:])
            engine.backward(loss)
            engine.step()
        losses.append(engine.last_loss)
        lrs.append(engine.get_lr()[0])
        norms.append(engine.get_global_grad_norm())
    assert engine.global_steps == STEPS
    return losses, lrs, norms


@functools.lru_cache(maxsize=None)
def serial_reference(global_batch: int, clip: float, optimizer: str = "adamw", skip: tuple[int, ...] = ()) -> SerialRun:
    """Plain PyTorch with trident's WarmupLR; the steps in `skip` are skipped (fp16 overflows)."""
    def schedule(opt):
        return build_scheduler(load_config({"train_micro_batch_size_per_gpu": 1, "scheduler": SCHEDULE}).scheduler, opt)
    data = make_tokens(global_batch)
    batches = [(b[:, :-1], b[:, 1:]) for b in data.split(global_batch)]
    return train_serial(make_model(), batches, optimizer, OPT_LR[optimizer], clip, schedule, skip=skip)


def serial_lrs() -> list[float]:
    """The learning rate after each of the STEPS schedule steps (WarmupLR, as the servers run it)."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
    schedule = build_scheduler(load_config({"train_micro_batch_size_per_gpu": 1, "scheduler": SCHEDULE}).scheduler, opt)
    lrs = []
    for _ in range(STEPS):
        opt.step()
        schedule.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


def run_ps(servers: int, micro: int, gas: int, clip: float, placement: str, optimizer: str = "adamw",
           precision: str = "fp32"):
    """Every rank: the first `servers` serve, the rest train through trident.initialize."""
    mesh = cached_mesh()
    cfg = config(servers, micro, gas, clip, placement, optimizer, precision)
    if dist.get_rank() < servers:
        result = serve(cfg, make_model(), mesh=mesh)
        return {"role": "server", "params": result.parameters, "version": result.version,
                "steps": result.worker_steps, "records": len(result.records)}
    engine, _, _, _ = trident.initialize(model=make_model(), config=cfg, mesh=mesh)
    assert engine.dp_world_size == dist.get_world_size() - servers
    assert engine.dp_rank == dist.get_rank() - servers
    losses, lrs, norms = train_loop(engine, micro, gas)
    weights = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    engine.close()
    return {"role": "worker", "losses": losses, "lrs": lrs, "norms": norms, "weights": weights,
            "bytes": engine.comm_bytes()}


@pytest.mark.parametrize("servers,workers,micro,gas,clip,placement", [
    (1, 2, 2, 2, 0.0, "balanced"),       # accumulation; CentralStorage-style single server
    (2, 2, 4, 1, 0.05, "balanced"),      # clipping on most steps: servers exchange squared norms
    (1, 3, 2, 1, 0.0, "round_robin"),
    (2, 3, 2, 2, 0.05, "round_robin"),
])
def test_sync_ps_matches_serial(servers, workers, micro, gas, clip, placement):
    ref = serial_reference(micro * gas * workers, clip)
    ref_losses, ref_lrs, ref_weights = ref.losses, serial_lrs(), ref.weights
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


def test_sync_ps_sgd_with_active_clipping_matches_serial_norm_for_norm():
    """Two servers each hold part of the averaged gradient and exchange squared norms: the
    clip coefficient every server applies comes from the exact global norm."""
    ref = serial_reference(8, SGD_CLIP, "sgd")
    assert max(ref.clip_coefs) < 1.0, f"clipping inactive on some step: {ref.clip_coefs}"
    results = run_on_ranks(4, run_ps, 2, 2, 2, SGD_CLIP, "balanced", "sgd")
    workers = [r for r in results if r["role"] == "worker"]
    per_step = zip(*(r["losses"] for r in workers))
    assert_losses_close([sum(s) / len(s) for s in per_step], ref.losses, rtol=1e-5)
    for r in workers:
        assert_norms_close(r["norms"], ref.norms, rtol=1e-6)
        assert_state_close(r["weights"], ref.weights, rtol=1e-5)
