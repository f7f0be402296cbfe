"""ZeRO beyond the loss curves: memory per rank, bytes moved, checkpoints, zero.Init,
GatheredParameters, mixed precision and models written without trident."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import trident
from trident.engine.host_allocator import tune_glibc_malloc
from trident.checkpointing.consolidate import get_fp32_state_dict_from_zero_checkpoint, load_state_dict_from_zero_checkpoint
from trident.cli.main import main as cli_main
from trident.models.gpt import GPT, GPTConfig
from trident.planner.memory import model_state_bytes, trident_state_bytes
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.parity import assert_losses_close, assert_state_close
from tests.parity.test_dp_equivalence import LR, make_model, make_tokens, mean_losses, serial_reference

# A GPT large enough that per-unit padding (< dp elements per unit) is far below 1%.
BIG = dict(vocab_size=128, seq_len=16, n_layer=2, n_head=4, d_model=64, dropout=0.0, bias=False)


def zero_cfg(stage: int, precision: str = "fp32", **zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "initial_scale_power": 8},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 20000, "stage3_param_persistence_threshold": 0,
                              **zero},
        "comms_logger": {"enabled": True},
        "steps_per_print": 0,
    }


def big_tokens(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, BIG["vocab_size"], (n, BIG["seq_len"] + 1), generator=g)


def one_step(stage: int, precision: str, zero: dict):
    mesh = cached_mesh()
    torch.manual_seed(0)
    engine, *_ = trident.initialize(model=GPT(GPTConfig(**BIG)), config=zero_cfg(stage, precision, **zero), mesh=mesh)
    data = big_tokens(4 * mesh.dp_size)
    for step in range(2):  # the second step runs on a recorded trace (stage 3 prefetch)
        batch = data[(2 * step + mesh.dp_rank) * 2:(2 * step + mesh.dp_rank) * 2 + 2]
        engine.comms_logger.reset()
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))
        engine.step()
    totals = {op: s.bytes for op, s in engine.comms_logger.totals().items()}
    return engine.memory_breakdown(), engine.reducer.numel, totals


def expected_model_states(stage: int, precision: str, phi: int, n: int) -> dict[str, float]:
    """The ZeRO paper's per-rank bytes, from the planner's one copy of the formulas: K = 12
    (fp32 masters + Adam moments) in mixed precision, K = 8 in fp32 (the parameters are their
    own masters)."""
    return model_state_bytes(phi, stage, n, trident_state_bytes(stage, precision, "adamw")).as_dict()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("world", [2, 4])
def test_memory_per_rank_matches_the_zero_formulas(world, precision):
    for stage in (1, 2, 3):
        results = run_on_ranks(world, one_step, stage, precision, {})
        for mem, phi, _ in results:
            expected = expected_model_states(stage, precision, phi, world)
            for key, value in expected.items():
                assert abs(mem[key] - value) <= 0.05 * value, (stage, key, mem[key], value)


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_moved_per_step_match_the_zero_figures(world):
    """Stages 1 and 2: reduce-scatter + all-gather = 2 Phi elements per step; stage 3 adds the
    backward re-gather (3 Phi) when nothing is kept between forward and backward, and keeps
    the last layers gathered (less than 3 Phi) with the default reuse distance."""
    for stage, zero, factor in [(1, {}, 2), (2, {}, 2), (3, {"stage3_max_reuse_distance": 0}, 3)]:
        for mem, phi, totals in run_on_ranks(world, one_step, stage, "fp32", zero):
            moved = sum(totals.values()) / 4  # fp32 elements
            assert abs(moved - factor * phi) <= 0.10 * factor * phi, (stage, totals, phi)
    for _, phi, totals in run_on_ranks(world, one_step, 3, "fp32", {}):
        assert 2 * phi <= sum(totals.values()) / 4 < 2.9 * phi, totals


# ---- checkpoints -------------------------------------------------------------------------------

def first_mean(results) -> list[float]:
    return mean_losses([r[:2] for r in results])


def resume_and_train(engine, mesh, micro: int, root: str, steps: int, save_at: int | None,
                     resume: bool) -> list[float]:
    """Load the latest checkpoint under `root` (if `resume`), train to `steps` on this rank's share
    of 8 sequences per step, saving at step `save_at`; the losses of the steps run."""
    start = 0
    if resume:
        engine.load_checkpoint(root)
        start = engine.global_steps
    data = make_tokens(8)
    losses = []
    for step in range(start, steps):
        s = step * 8 + mesh.dp_rank * micro
        batch = data[s:s + micro]
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))
        engine.step()
        losses.append(engine.last_loss)
        if save_at is not None and engine.global_steps == save_at:
            engine.save_checkpoint(root)
    return losses


def train_and_checkpoint(stage: int, root: str, steps: int, save_at: int | None, resume: bool):
    mesh = cached_mesh()
    micro = 8 // mesh.dp_size  # global batch 8 whatever the layout
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_clipping": 0.05, "steps_per_print": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 100}}
    engine, *_ = trident.initialize(model=make_model(), config=cfg, mesh=mesh)
    losses = resume_and_train(engine, mesh, micro, root, steps, save_at, resume)
    saved_16bit = engine.save_16bit_model(root, "model16.safetensors")
    return losses, {k: v.float() for k, v in engine.consolidated_state_dict().items()}, saved_16bit


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_resume_and_consolidate(stage, tmp_path):
    root = str(tmp_path / "ckpt")
    full = run_on_ranks(2, train_and_checkpoint, stage, root, 8, 4, False)
    resumed = run_on_ranks(2, train_and_checkpoint, stage, root + "_unused", 8, None, False)  # no load
    again = run_on_ranks(2, train_and_checkpoint, stage, root, 8, None, True)
    assert_losses_close(first_mean(again), first_mean(full)[4:], rtol=1e-6)
    assert_state_close(again[0][1], full[0][1], rtol=1e-6)
    assert resumed[0][0] == full[0][0]  # a fresh run is deterministic: the resume test means something
    assert [saved for _, _, saved in full] == [stage != 3] * 2  # stage 3 needs the gather flag

    # Offline consolidation of the step-4 checkpoint equals 4 steps of one process.
    ref4 = run_on_ranks(1, train_and_checkpoint, 0, str(tmp_path / "serial"), 4, None, False)[0][1]
    consolidated = get_fp32_state_dict_from_zero_checkpoint(root)
    assert_state_close(consolidated, ref4, rtol=1e-5)
    out = tmp_path / "model.safetensors"
    assert cli_main(["checkpoint", "consolidate", root, str(out)]) == 0
    model = load_state_dict_from_zero_checkpoint(make_model(), root)
    assert_state_close({k: v for k, v in model.state_dict().items()}, ref4, rtol=1e-5)


def test_consolidate_names_a_damaged_partition(tmp_path, capsys):
    root = tmp_path / "ckpt"
    run_on_ranks(2, train_and_checkpoint, 2, str(root), 2, 2, False)
    part = root / "global_step2" / "zero_pp0_tp0_dp1.pt"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    assert cli_main(["checkpoint", "consolidate", str(root), str(tmp_path / "out.safetensors")]) == 1
    assert "zero_pp0_tp0_dp1.pt: checksum mismatch" in capsys.readouterr().err


# ---- a model written without trident, zero.Init and GatheredParameters -----------------------

class Shared(nn.Module):
    """Applied twice per forward."""

    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class HFStyle(nn.Module):
    """Nested containers, a parameter on the root, a module reused, a tied output layer."""

    def __init__(self, vocab: int = 50, d: int = 24):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(8, d) * 0.1)
        self.embeddings = nn.ModuleDict({"tok": nn.Embedding(vocab, d)})
        self.encoder = nn.ModuleList([nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(),
                                                    nn.Linear(2 * d, d)) for _ in range(2)])
        self.shared = Shared(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embeddings["tok"].weight

    def forward(self, idx, targets):
        x = self.embeddings["tok"](idx) + self.pos[: idx.shape[1]]
        for block in self.encoder:
            x = x + block(x)
        x = self.shared(self.shared(x))
        logits = self.head(x)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def hf_tokens() -> torch.Tensor:
    return torch.randint(0, 50, (40, 9), generator=torch.Generator().manual_seed(5))


def train_hf(stage: int, use_init: bool, steps: int = 10):
    mesh = cached_mesh()
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 30,
                                 "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 500}}
    torch.manual_seed(0)
    if use_init:
        with trident.zero.Init(mesh=mesh):
            model = HFStyle()
        held = sum(p.numel() for p in model.parameters())
        shards = sum(p._trident_shard.numel() for p in model.parameters())
        assert held == 0 and shards < 0.6 * sum(int(torch.Size(p._trident_shape).numel()) for p in model.parameters())
    else:
        model = HFStyle()
    engine, *_ = trident.initialize(model=model, config=cfg, mesh=mesh)
    data, dp, rank = hf_tokens(), mesh.dp_size, mesh.dp_rank
    losses = []
    for step in range(steps):
        micro = 4 // dp
        s = step * 4 + rank * micro
        batch = data[s:s + micro]
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))
        engine.step()
        losses.append(engine.last_loss)
    return losses, {k: v.float() for k, v in engine.consolidated_state_dict().items()}


def test_stage3_on_a_plain_nested_model_with_reuse_and_tying():
    serial = run_on_ranks(1, train_hf, 0, False)
    assert_losses_close(first_mean(run_on_ranks(2, train_hf, 0, False)), serial[0][0], rtol=1e-5)
    for use_init in (False, True):
        results = run_on_ranks(2, train_hf, 3, use_init)
        assert_losses_close(first_mean(results), serial[0][0], rtol=1e-5)
        for _, weights in results:
            assert_state_close(weights, serial[0][1], rtol=1e-5)


def gathered_edit():
    mesh = cached_mesh()
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0,
           "optimizer": {"type": "SGD", "params": {"lr": 1e-30}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    torch.manual_seed(0)
    engine, *_ = trident.initialize(model=HFStyle(), config=cfg, mesh=mesh)
    weight = engine.module.encoder[0][1].weight
    assert weight.numel() == 0  # partitioned outside forward
    with trident.zero.GatheredParameters([weight], modifier_rank=0):
        assert weight.shape == (48, 24)
        if mesh.dp_rank == 0:
            weight.data.fill_(0.5)
    assert weight.numel() == 0
    batch = hf_tokens()[:2]
    engine.backward(engine(batch[:, :-1], batch[:, 1:]))
    engine.step()  # lr ~0: the edit must survive the step (masters were updated too)
    with trident.zero.GatheredParameters([weight]):
        return float(weight.min()), float(weight.max())


def test_gathered_parameters_modifier_is_seen_by_every_rank():
    assert run_on_ranks(2, gathered_edit) == [(0.5, 0.5), (0.5, 0.5)]


def build_large_under_init(n_layers: int, width: int):
    mesh = cached_mesh()
    # Allocations above 1 MiB get their own mapping, unmapped when freed, so the resident size
    # follows the live tensors instead of what glibc keeps for reuse.
    tune_glibc_malloc(trim_threshold_mb=1, mmap_threshold_mb=1)
    with open("/proc/self/clear_refs", "w") as f:  # restart the peak (VmHWM): the pool's worker ran other tests
        f.write("5")
    with open("/proc/self/statm") as f:
        rss_before = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    torch.manual_seed(0)
    with trident.zero.Init(mesh=mesh):
        model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(n_layers)])
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    shard = sum(p._trident_shard.numel() * 4 for p in model.parameters())
    del model
    return peak - rss_before, shard


def test_zero_init_never_holds_the_whole_model():
    """A 48M-parameter (192 MB) model built at dp=2: the process grows by about its 96 MB share
    plus one layer being initialised, far below the whole model."""
    full = 12 * 2000 * 2000 * 4
    for growth, shard in run_on_ranks(2, build_large_under_init, 12, 2000):
        assert shard == full // 2
        assert growth < 0.75 * full, (growth, full)


# ---- mixed precision ---------------------------------------------------------------------------

def train_mixed(stage: int, precision: str, steps: int = 12):
    mesh = cached_mesh()
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 0, "gradient_clipping": 0.05,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
           "bf16": {"enabled": precision == "bf16"},
           "fp16": {"enabled": precision == "fp16", "initial_scale_power": 24, "hysteresis": 1},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 100}}
    engine, *_ = trident.initialize(model=make_model(), config=cfg, mesh=mesh)
    data = make_tokens(4 * mesh.dp_size)
    losses = []
    for step in range(steps):
        s = (step * mesh.dp_size + mesh.dp_rank) * 4
        batch = data[s:s + 4]
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))
        engine.step()
        losses.append(engine.last_loss)
    return losses, engine.skipped_steps, engine.loss_scale


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_and_fp16_track_fp32(stage):
    """16-bit ZeRO follows fp32 training to within 16-bit noise. fp16 starts at scale 2**24, so
    the first steps overflow and are skipped (on every rank alike) until the scale fits, and the
    rest train (at 2**40 no step of the 12 ever fitted, and the test compared nothing)."""
    ref = serial_reference(8, 0.05).losses
    bf16 = run_on_ranks(2, train_mixed, stage, "bf16")
    assert_losses_close(first_mean(bf16), ref[:12], rtol=2e-2)
    fp16 = run_on_ranks(2, train_mixed, stage, "fp16")
    skipped = {s for _, s, _ in fp16}
    assert len(skipped) == 1 and 0 < skipped.pop() <= 6
    assert fp16[0][2] == 2.0 ** (24 - fp16[0][1])
    assert abs(first_mean(fp16)[-1] - ref[11 - fp16[0][1]]) < 0.05 * ref[0]


def save_bf16(stage: int, root: str):
    mesh = cached_mesh()
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 0, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": LR}}, "zero_optimization": {"stage": stage}}
    engine, *_ = trident.initialize(model=make_model(), config=cfg, mesh=mesh)
    batch = make_tokens(8)[mesh.dp_rank * 4:mesh.dp_rank * 4 + 4]
    engine.backward(engine(batch[:, :-1], batch[:, 1:]))
    engine.step()
    engine.save_checkpoint(root)
    if stage == 0:
        return [m.clone() for m in engine.reducer.state_dict()["master_weights"]]
    return None


@pytest.mark.parametrize("stage", [0, 1])
def test_consolidation_of_bf16_runs_returns_the_fp32_masters(stage, tmp_path):
    root = str(tmp_path / "ckpt")
    results = run_on_ranks(2, save_bf16, stage, root)
    state = get_fp32_state_dict_from_zero_checkpoint(root)
    assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
    bf16 = {k: v.float() for k, v in load_file(str(tmp_path / "ckpt" / "global_step1" / "model.safetensors")).items()}
    for name, value in bf16.items():  # the masters round to the saved bf16 weights, and are finer
        assert torch.equal(state[name].bfloat16().float(), value), name
    assert any(not torch.equal(state[n], bf16[n]) for n in bf16)
    if stage == 0:
        flat = torch.cat([m.reshape(-1) for m in results[0]])
        assert flat.numel() == sum(state[n].numel() for n in bf16 if n != "lm_head.weight")
