"""The engine's contract on real gloo ranks: fp16 overflow handling, communication schedule,
checkpoint resume in fresh processes, corrupt-checkpoint detection, and its public surface."""

from __future__ import annotations

import json

import pytest
import torch

import trident
from trident.checkpointing.state import CheckpointError
from trident.models.gpt import GPT, GPTConfig
from trident.models.toy import TinyMLP
from trident.testing.distributed import cached_mesh, run_on_ranks, shutdown_pool
from trident.testing.parity import assert_state_close


def mlp_config(**extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 0,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    cfg.update(extra)
    return cfg


def mlp_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)


def fp16_overflow_on_one_rank():
    """Rank 1 injects inf into its loss at step 3: every rank must skip that step."""
    mesh = cached_mesh()
    torch.manual_seed(0)
    cfg = mlp_config(fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1})
    engine, *_ = trident.initialize(model=TinyMLP(), config=cfg, mesh=mesh)
    scales, skipped, snapshots = [], [], []
    for step in range(5):
        x, y = mlp_batch(step, mesh.dp_rank)
        loss = engine(x, y)
        if step == 2 and mesh.dp_rank == 1:
            loss = loss * float("inf")
        before = [p.detach().clone() for p in engine.module.parameters()]
        engine.backward(loss)
        engine.step()
        unchanged = all(torch.equal(b, p) for b, p in zip(before, engine.module.parameters()))
        snapshots.append(unchanged)
        scales.append(engine.loss_scale)
        skipped.append(engine.skipped_steps)
    return scales, skipped, snapshots, [p.detach().float() for p in engine.module.parameters()]


def test_fp16_overflow_on_one_rank_skips_everywhere():
    (s0, k0, u0, w0), (s1, k1, u1, w1) = run_on_ranks(2, fp16_overflow_on_one_rank)
    assert s0 == s1 == [256.0, 256.0, 128.0, 128.0, 128.0]
    assert k0 == k1 == [0, 0, 1, 1, 1]
    assert u0 == u1 == [False, False, True, False, False]
    for a, b in zip(w0, w1):
        assert torch.equal(a, b)


def comm_schedule():
    """No communication before the accumulation boundary; several buckets at the boundary."""
    mesh = cached_mesh()
    torch.manual_seed(0)
    cfg = mlp_config(gradient_accumulation_steps=3, comms_logger={"enabled": True},
                     zero_optimization={"stage": 0, "reduce_bucket_size": 300})
    engine, *_ = trident.initialize(model=TinyMLP(), config=cfg, mesh=mesh)
    counts = []
    for micro in range(3):
        x, y = mlp_batch(micro, mesh.dp_rank)
        engine.backward(engine(x, y))
        engine.step()
        totals = engine.comms_logger.totals()
        counts.append(totals["all_reduce"].calls if "all_reduce" in totals else 0)
    n_params = sum(p.numel() for p in engine.module.parameters())
    return counts, len(engine.reducer.reducer.buckets), totals["all_reduce"].bytes, n_params


def test_no_communication_before_boundary_and_bucketed_after():
    (counts, n_buckets, nbytes, n_params), _ = run_on_ranks(2, comm_schedule)
    assert n_buckets > 1
    assert counts == [0, 0, n_buckets]
    assert nbytes == 4 * n_params  # fp32 gradients, each element sent once


def predivide_equivalence(predivide: float, prescale: bool):
    mesh = cached_mesh()
    torch.manual_seed(0)
    cfg = mlp_config(gradient_predivide_factor=predivide, prescale_gradients=prescale)
    engine, *_ = trident.initialize(model=TinyMLP(), config=cfg, mesh=mesh)
    for step in range(3):
        x, y = mlp_batch(step, mesh.dp_rank)
        engine.backward(engine(x, y))
        engine.step()
    return {k: v.clone() for k, v in engine.module.state_dict().items()}


def test_gradient_predivide_and_prescale_do_not_change_the_mean():
    base, _ = run_on_ranks(2, predivide_equivalence, 1.0, False)
    pre, _ = run_on_ranks(2, predivide_equivalence, 2.0, False)
    prescaled, _ = run_on_ranks(2, predivide_equivalence, 1.0, True)
    assert_state_close(pre, base, rtol=1e-6)
    assert_state_close(prescaled, base, rtol=1e-6)


# ---- resume --------------------------------------------------------------------------------

RESUME_MODEL = dict(vocab_size=53, seq_len=12, n_layer=2, n_head=2, d_model=24, dropout=0.1)


def resume_config() -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 0,
            "optimizer": {"type": "AdamW", "params": {"lr": 2e-3}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 2e-3}},
            "fp16": {"enabled": True, "initial_scale_power": 12}}


def train_gpt(start: int, stop: int, ckpt_dir: str, save_at: int | None, load: bool):
    mesh = cached_mesh()
    torch.manual_seed(0)
    model = GPT(GPTConfig(**RESUME_MODEL))
    engine, *_ = trident.initialize(model=model, config=resume_config(), mesh=mesh)
    torch.manual_seed(100 + mesh.global_rank)  # dropout differs per rank
    if load:
        path, client = engine.load_checkpoint(ckpt_dir)
        assert path is not None and client["next_step"] == start
    g = torch.Generator().manual_seed(5)
    data = torch.randint(0, 53, (stop * 8, 13), generator=g)
    losses = []
    for step in range(start, stop):
        for k in range(2):
            i = step * 8 + mesh.dp_rank * 4 + k * 2
            batch = data[i:i + 2]
            engine.backward(engine(batch[:, :-1], batch[:, 1:]))
            engine.step()
        losses.append(engine.last_loss)
        if save_at is not None and step + 1 == save_at:
            engine.save_checkpoint(ckpt_dir, client_state={"next_step": step + 1})
    return losses, {k: v.float().clone() for k, v in engine.module.state_dict().items()}, engine.global_steps


def test_resume_in_fresh_processes_matches_uninterrupted(tmp_path):
    full = run_on_ranks(2, train_gpt, 0, 20, str(tmp_path / "a"), None, False)
    run_on_ranks(2, train_gpt, 0, 10, str(tmp_path / "b"), 10, False)
    shutdown_pool(2)  # the second half runs in new processes
    resumed = run_on_ranks(2, train_gpt, 10, 20, str(tmp_path / "b"), None, True)
    for (full_losses, full_w, _), (res_losses, res_w, steps) in zip(full, resumed):
        assert steps == 20
        assert res_losses == full_losses[10:]  # exact: same bits, same RNG streams
        assert_state_close(res_w, full_w, rtol=0.0)
    latest = (tmp_path / "b" / "latest").read_text()
    manifest = json.loads((tmp_path / "b" / latest / "manifest.json").read_text())
    assert manifest["layout"]["dp"] == 2 and "model.safetensors" in manifest["files"]


def load_corrupt(ckpt_dir: str):
    mesh = cached_mesh()
    torch.manual_seed(0)
    engine, *_ = trident.initialize(model=GPT(GPTConfig(**RESUME_MODEL)), config=resume_config(), mesh=mesh)
    try:
        engine.load_checkpoint(ckpt_dir)
    except CheckpointError as err:
        return str(err)
    return "loaded"


def test_corrupt_checkpoint_is_named(tmp_path):
    run_on_ranks(2, train_gpt, 0, 2, str(tmp_path), 2, False)
    folder = tmp_path / (tmp_path / "latest").read_text()
    state = folder / "training_state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    messages = run_on_ranks(2, load_corrupt, str(tmp_path))
    for m in messages:
        assert "training_state.pt" in m and "checksum mismatch" in m


def test_no_checkpoint_returns_none(tmp_path):
    assert run_on_ranks(1, load_missing, str(tmp_path)) == [(None, None)]


def load_missing(ckpt_dir: str):
    mesh = cached_mesh()
    engine, *_ = trident.initialize(model=TinyMLP(), config=mlp_config(), mesh=mesh)
    return engine.load_checkpoint(ckpt_dir)


# ---- surface -------------------------------------------------------------------------------

def engine_surface():
    mesh = cached_mesh()
    torch.manual_seed(0)
    cfg = mlp_config(train_batch_size=16, gradient_clipping=1.0,
                     scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 0.1,
                                                               "warmup_type": "linear"}})
    engine, optimizer, _, scheduler = trident.initialize(model=TinyMLP(), config=cfg, mesh=mesh)
    out = {
        "dp": (engine.dp_rank, engine.dp_world_size, engine.global_rank, engine.world_size),
        "gas": engine.gradient_accumulation_steps(),
        "boundary": [],
        "lrs": [],
    }
    for micro in range(4):
        out["boundary"].append(engine.is_gradient_accumulation_boundary())
        x, y = mlp_batch(micro, mesh.dp_rank)
        engine.backward(engine(x, y))
        engine.step()
        out["lrs"].append(engine.get_lr()[0])
    out["steps"] = engine.global_steps
    out["norm"] = engine.get_global_grad_norm()
    out["optimizer_is_engines"] = optimizer is engine.optimizer and scheduler is engine.lr_scheduler
    with pytest.raises(ValueError, match="scalar loss"):
        engine.backward(engine(x, y) * torch.ones(2))
    engine.backward(engine(x, y))  # not a boundary: no communication, so one rank may do this
    with pytest.raises(RuntimeError, match="twice without engine.step"):
        engine.backward(engine(x, y))
    engine.eval()
    out["eval_mode"] = not engine.module.training
    return out


def test_engine_surface():
    r0, r1 = run_on_ranks(2, engine_surface)
    assert r0["dp"] == (0, 2, 0, 2) and r1["dp"] == (1, 2, 1, 2)
    assert r0["gas"] == 2  # 16 = 4 x gas x 2
    assert r0["boundary"] == [False, True, False, True]
    assert r0["steps"] == 2
    # the scheduler moves once per optimizer step, not per micro-step, and warms up towards 0.1
    assert r0["lrs"][1] == r0["lrs"][2] < r0["lrs"][3] <= 0.1
    assert r0["norm"] is not None and r0["norm"] > 0 and r0["norm"] == r1["norm"]
    assert r0["optimizer_is_engines"] and r0["eval_mode"]


# ---- memory accounting -----------------------------------------------------------------------

def memory_after_one_step(precision: str):
    mesh = cached_mesh()
    torch.manual_seed(0)
    cfg = mlp_config(optimizer={"type": "AdamW", "params": {"lr": 1e-3}}, bf16={"enabled": precision == "bf16"})
    engine, *_ = trident.initialize(model=TinyMLP(), config=cfg, mesh=mesh)
    x, y = mlp_batch(0, mesh.dp_rank)
    engine.backward(engine(x, y))
    engine.step()
    return engine.memory_breakdown(), sum(p.numel() for p in engine.module.parameters())


@pytest.mark.parametrize("precision,param_bytes,master_bytes", [("fp32", 4, 0), ("bf16", 2, 4)])
def test_memory_breakdown_matches_the_formula(precision, param_bytes, master_bytes):
    """Plain DP holds per parameter: weights (4 or 2 bytes), an fp32 gradient (4), fp32 masters
    under bf16 (4) and Adam's two fp32 moments (8), on every rank; masters count as optimizer
    states, as in the ZeRO paper."""
    (mem, phi), _ = run_on_ranks(2, memory_after_one_step, precision)
    assert mem == {"parameters": param_bytes * phi, "gradients": 4 * phi,
                   "optimizer_states": (master_bytes + 8) * phi}


# ---- parameters without a gradient -----------------------------------------------------------

class Branchy(torch.nn.Module):
    """`b` only takes part when asked: its gradient must read zero in the other windows."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x, y, use_b: bool):
        out = self.a(x) + (self.b(x) if use_b else 0)
        return torch.nn.functional.mse_loss(out, y)


def unused_parameter_steps(gas: int):
    mesh = cached_mesh()
    torch.manual_seed(0)
    engine, *_ = trident.initialize(model=Branchy(), config=mlp_config(gradient_accumulation_steps=gas), mesh=mesh)
    b_weights = []
    for step in range(3):
        for micro in range(gas):
            x, y = mlp_batch(step * gas + micro, mesh.dp_rank)
            use_b = step == 0 and micro == 0  # b gets a gradient in the first window only
            engine.backward(engine(x, y, use_b))
            engine.step()
        b_weights.append(engine.module.b.weight.detach().clone())
    return b_weights


@pytest.mark.parametrize("gas", [1, 2])
def test_parameter_without_gradient_is_not_updated(gas):
    for b_weights in run_on_ranks(2, unused_parameter_steps, gas):
        assert torch.equal(b_weights[0], b_weights[1]) and torch.equal(b_weights[1], b_weights[2])


# ---- DeepSpeed-style entry points and monitors -------------------------------------------------

def deepspeed_style_run(config_path: str):
    """`args.deepspeed_config` as in DeepSpeed scripts; monitors and timers from the config."""
    import argparse
    mesh = cached_mesh()
    torch.manual_seed(0)
    args = argparse.Namespace(deepspeed_config=config_path)
    engine, *_ = trident.initialize(args=args, model=TinyMLP(), mesh=mesh)
    for step in range(3):
        x, y = mlp_batch(step, mesh.dp_rank)
        engine.backward(engine(x, y))
        engine.step()
    return sorted(engine.timers.totals), engine.global_samples


def test_args_config_monitors_and_timers(tmp_path):
    cfg = mlp_config(wall_clock_breakdown=True, steps_per_print=0,
                     csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "job"},
                     tensorboard={"enabled": True, "output_path": str(tmp_path), "job_name": "tb"})
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))
    (phases, samples), _ = run_on_ranks(2, deepspeed_style_run, str(path))
    assert phases == ["backward", "forward", "step"]
    assert samples == 3 * 8  # global_samples counts the global batch: 4 per rank x 2 ranks
    lines = (tmp_path / "job" / "metrics.csv").read_text().splitlines()
    assert lines[0].split(",")[:2] == ["step", "Train/Samples/train_loss"]
    assert [line.split(",")[0] for line in lines[1:]] == ["8", "16", "24"]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
