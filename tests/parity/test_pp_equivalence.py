"""Pipeline parallelism trains to the same losses and weights as one process (fp32, rtol 1e-5).

The serial reference is the plain GPT in the test process, one forward over the whole global
batch per step, AdamW, torch's clip_grad_norm_. The pipelined run is the same GPT written as a
PipelineModule (tied input/output embeddings across the first and last stage), loaded with the
reference's initial weights, on gloo ranks; every rank reports its stage's weights under GPT's
names, and each is compared with the reference (tensor-parallel shards merged first).
"""

from __future__ import annotations

import functools

import pytest
import torch

import trident
from trident.engine.pipeline_engine import PipelineEngine
from trident.models.gpt import GPT, GPTConfig
from trident.models.gpt_pipe import gpt_pipe, gpt_shard_specs, gpt_state_dict, load_gpt_state_dict
from trident.tensor_parallel import merge_state_dicts, parallelize
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.parity import (SerialRun, assert_losses_close, assert_norms_close, assert_state_close,
                                    optimizer_section, precision_sections, train_serial)

STEPS = 20
MICRO = 2
# No biases: see test_dp_equivalence (a key bias's gradient is pure rounding noise under Adam).
MODEL = dict(vocab_size=61, seq_len=16, n_layer=4, n_head=2, d_model=32, dropout=0.0, bias=False)
LR = 3e-3
OPT_LR = {"adamw": LR, "sgd": 0.5, "muon": LR}
SGD_CLIP = 0.05  # below the gradient norm on every step of every SGD case
# AdamW divides each step by sqrt(v): where a gradient is near zero (parts of the query/key
# weights here) it turns fp32 rounding noise into steps of full size, and after 20 steps the
# qkv weights of an exact layout sit up to ~1.1e-5 from serial (two serial runs whose clip
# norms differ by 1e-7 already differ by 1.6e-6). SGD has no such amplifier: the same layouts
# agree to ~2e-7, so the SGD cases carry the tight check.
WEIGHT_RTOL = {"adamw": 2e-5, "sgd": 1e-5, "muon": 1e-5}
TP_PLAN = {"attn.qkv": "column", "attn.proj": "row", "mlp.fc": "column", "mlp.proj": "row"}  # heads kept whole


def make_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**MODEL))


def make_tokens(global_batch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, MODEL["vocab_size"], (STEPS * global_batch, MODEL["seq_len"] + 1), generator=g)


@functools.lru_cache(maxsize=None)
def serial_reference(global_batch: int, clip: float, steps: int = STEPS, optimizer: str = "adamw") -> SerialRun:
    data = make_tokens(global_batch)[:steps * global_batch]
    batches = [(b[:, :-1], b[:, 1:]) for b in data.split(global_batch)]
    return train_serial(make_gpt(), batches, optimizer, OPT_LR[optimizer], clip)


def pipe_steps(engine, mesh, data: torch.Tensor, steps: int, micro: int, global_batch: int):
    """`steps` train_batch calls, each on this dp rank's micro-batches of a global batch of
    `data` rows; the per-step losses and global gradient norms."""
    per_rank = global_batch // mesh.dp_size
    losses, norms = [], []
    for step in range(steps):
        mine = data[step * global_batch + mesh.dp_rank * per_rank:][:per_rank]
        batches = [(mine[k:k + micro, :-1], mine[k:k + micro, 1:]) for k in range(0, per_rank, micro)]
        losses.append(float(engine.train_batch(iter(batches))))
        norms.append(engine.get_global_grad_norm())
    return losses, norms


def sgd_pipe_config(pp: int, tp: int, zero_stage: int, micro_batches: int, lr: float, clip: float) -> dict:
    """A 1F1B pipeline config with SGD + momentum and clipping (frozen and LoRA parity runs)."""
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": micro_batches,
            "optimizer": optimizer_section("sgd", lr), "gradient_clipping": clip, "steps_per_print": 0,
            "zero_optimization": {"stage": zero_stage},
            "pipeline": {"stages": pp, "schedule": "1f1b", "partition_method": "uniform"},
            "tensor_parallel": {"size": tp}}


def pipeline_engine(model, config: dict, mesh) -> PipelineEngine:
    """trident.initialize on a PipelineModule returns a PipelineEngine."""
    engine, *_ = trident.initialize(model=model, config=config, mesh=mesh)
    assert isinstance(engine, PipelineEngine)
    return engine


def train_pp(pp: int, schedule: str, v: int, micro_batches: int, clip: float, zero_stage: int = 0,
             tp: int = 1, optimizer: str = "adamw", precision: str = "fp32"):
    """Runs on every rank: the pipelined GPT over the whole world (dp = world / (pp tp)).

    Returns the losses, this rank's weights under GPT's names, their tp shard specs, the rank's
    (pp, dp, tp) coordinates and the per-step global gradient norms.
    """
    mesh = cached_mesh(pp=pp, tp=tp)
    cfg = GPTConfig(**MODEL)
    pipe = gpt_pipe(cfg, pp, partition_method="uniform", virtual_stages=v, stage_id=mesh.pp_rank)
    load_gpt_state_dict(pipe, make_gpt().state_dict(), cfg)
    if tp > 1:
        parallelize(pipe, TP_PLAN, mesh)  # slices the loaded full weights
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": micro_batches,
        "optimizer": optimizer_section(optimizer, OPT_LR[optimizer]),
        "gradient_clipping": clip,
        "zero_optimization": {"stage": zero_stage},
        "pipeline": {"stages": pp, "schedule": schedule, "virtual_stages": v, "partition_method": "uniform"},
        "tensor_parallel": {"size": tp},
        "steps_per_print": 0,
        **precision_sections(precision),
    }
    engine = pipeline_engine(pipe, config, mesh)
    global_batch = MICRO * micro_batches * mesh.dp_size
    losses, norms = pipe_steps(engine, mesh, make_tokens(global_batch), STEPS, MICRO, global_batch)
    assert engine.global_steps == STEPS and engine.micro_steps == STEPS * micro_batches
    weights = {k: v.detach().float().clone() for k, v in gpt_state_dict(pipe, cfg).items()}
    return losses, weights, gpt_shard_specs(pipe, cfg), (mesh.pp_rank, mesh.dp_rank, mesh.tp_rank), norms


def check(results, global_batch: int, clip: float, steps: int = STEPS, optimizer: str = "adamw") -> None:
    """Every rank's losses and the merged weights of every (pp, dp) replica against serial.
    Each result is (losses, weights under GPT's names, tp specs, (pp, dp, tp), norms, ...).
    With SGD, clipping must be active on every step and every rank's norm equal the serial one."""
    ref = serial_reference(global_batch, clip, steps, optimizer)
    ref_losses, ref_weights = ref.losses, ref.weights
    if optimizer != "adamw":
        assert max(ref.clip_coefs) < 1.0, f"clipping inactive on some step: {ref.clip_coefs}"
    shards: dict[tuple, list] = {}
    for losses, weights, specs, (pp, dp, tp), norms, *_ in results:
        assert_losses_close(losses, ref_losses, rtol=1e-5)  # every rank reports the batch's loss
        if optimizer != "adamw":
            assert_norms_close(norms, ref.norms, rtol=1e-6)
        shards.setdefault((pp, dp), []).append((tp, weights, specs))
    covered = set()
    for ranks in shards.values():
        ranks.sort(key=lambda r: r[0])
        weights = merge_state_dicts([w for _, w, _ in ranks], ranks[0][2]) if len(ranks) > 1 else ranks[0][1]
        assert_state_close(weights, {k: ref_weights[k] for k in weights}, rtol=WEIGHT_RTOL[optimizer])
        covered |= weights.keys()
    assert covered == set(ref_weights)


SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)]


@pytest.mark.parametrize("schedule,v", SCHEDULES)
def test_pp2_matches_serial(schedule, v):
    check(run_on_ranks(2, train_pp, 2, schedule, v, 4, 0.0), MICRO * 4, 0.0)


@pytest.mark.parametrize("schedule,v", SCHEDULES)
def test_pp4_matches_serial(schedule, v):
    check(run_on_ranks(4, train_pp, 4, schedule, v, 4, 0.0), MICRO * 4, 0.0)


def test_pp2_with_clipping_counts_the_tied_embedding_once():
    """Clipping is active on most steps: a tied weight counted twice would shrink every update."""
    check(run_on_ranks(2, train_pp, 2, "1f1b", 1, 3, 0.05), MICRO * 3, 0.05)


@pytest.mark.parametrize("schedule,zero_stage", [("1f1b", 0), ("zb_h1", 1)])
def test_pp2_dp2_matches_serial(schedule, zero_stage):
    check(run_on_ranks(4, train_pp, 2, schedule, 1, 2, 0.05, zero_stage), MICRO * 2 * 2, 0.05)


@pytest.mark.parametrize("world,zero_stage", [(2, 0), (4, 1)], ids=["pp2", "pp2-dp2-zero1"])
def test_pp2_muon_with_active_clipping_matches_serial(world, zero_stage):
    """Muon on each stage's whole matrices (AdamW for the tied embedding, wpe and norms); with
    dp 2 under ZeRO-1 each stage deals its matrices to owner ranks of its own dp group."""
    check(run_on_ranks(world, train_pp, 2, "1f1b", 1, 3, 0.05, zero_stage, 1, "muon"), MICRO * 3 * (world // 2),
          0.05, optimizer="muon")


def test_pp2_tp2_matches_serial():
    """Each stage's attention and MLP split over 2 tensor-parallel ranks; embeddings replicated."""
    check(run_on_ranks(4, train_pp, 2, "1f1b", 1, 4, 0.05, 0, 2), MICRO * 4, 0.05)


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_single_stage_pipeline_with_zero_2_and_3_matches_serial(zero_stage):
    """A PipelineModule on one stage takes every ZeRO stage (layouts may change pp between runs)."""
    check(run_on_ranks(2, train_pp, 1, "1f1b", 1, 2, 0.05, zero_stage), MICRO * 2 * 2, 0.05)


@pytest.mark.parametrize("pp,tp,zero_stage", [(2, 1, 0), (2, 1, 1), (2, 2, 0)], ids=["pp2", "pp2-dp2-zero1", "pp2-tp2"])
def test_pp_sgd_with_active_clipping_matches_serial_norm_for_norm(pp, tp, zero_stage):
    """The tied embedding's gradient (summed over the first and last stage) counted once, each
    stage's parameters once, tp slices slice by slice."""
    world = 4 if (zero_stage or tp > 1) else 2
    check(run_on_ranks(world, train_pp, pp, "1f1b", 1, 2, SGD_CLIP, zero_stage, tp, "sgd"),
          MICRO * 2 * (world // (pp * tp)), SGD_CLIP, optimizer="sgd")
