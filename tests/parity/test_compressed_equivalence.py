"""The 1-bit optimizers (OneBitAdam, ZeroOneAdam, OneBitLamb) on 2 and 4 gloo ranks.

* Warm-up equals the uncompressed twin: the same optimizer class on one process (where its
  compressed all-reduce is the identity) over the whole global batch, with active clipping;
  losses and weights to 1e-5, gradient norms to 1e-6.
* After warm-up, the bytes each rank puts on the wire per step (comms logger, bus bytes, the
  nccl-tests convention) are at most 1/16 of a warm-up step's fp32 all-reduce.
* A checkpoint taken in the compressed phase resumes bit for bit (error buffers, counters and,
  for 0/1 Adam's local steps, each rank's own parameters).
* A non-finite gradient on one rank in the compressed phase skips the step on every rank.
"""

from __future__ import annotations

import math

import pytest
import torch

import trident
from trident.models.gpt import GPT, GPTConfig
from trident.optim.onebit_adam import OneBitAdam
from trident.optim.onebit_lamb import OneBitLamb
from trident.optim.zero_one_adam import ZeroOneAdam
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.parity import assert_losses_close, assert_norms_close, assert_state_close

# the dp parity test's GPT and tokens (its STEPS >= ours, and the first steps' data are the same)
from tests.parity.test_dp_equivalence import MODEL, make_model, make_tokens

CLIP = 0.05  # below the gradient norm on every step: clipping is active throughout
STEPS = 10
CLASSES = {"OneBitAdam": OneBitAdam, "ZeroOneAdam": ZeroOneAdam, "OneBitLamb": OneBitLamb}
PARAMS = {
    "OneBitAdam": {"lr": 3e-3, "freeze_step": 4, "weight_decay": 0.01},
    # steps 1-4 all-reduce; then the interval doubles (5: 1-bit gradient, 6: full); from 7 local
    # steps, syncing every step twice, then every 2nd step (9 sends nothing, 10 syncs)
    "ZeroOneAdam": {"lr": 3e-3, "var_freeze_step": 6, "var_update_scaler": 4, "local_step_scaler": 2,
                    "local_step_clipper": 2, "weight_decay": 0.01},
    "OneBitLamb": {"lr": 3e-3, "freeze_step": 4, "weight_decay": 0.01},
}
WARMUP = 4  # steps that equal the uncompressed twin, for each of them
COMPRESSED_STEPS = {"OneBitAdam": [5, 6, 7, 8, 9, 10], "ZeroOneAdam": [5, 7, 8, 9, 10],
                    "OneBitLamb": [5, 6, 7, 8, 9, 10]}


def config(kind: str, micro: int, gas: int) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
            "optimizer": {"type": kind, "params": PARAMS[kind]}, "gradient_clipping": CLIP,
            "zero_optimization": {"stage": 0, "reduce_bucket_size": 5000}, "comms_logger": {"enabled": True},
            "steps_per_print": 0}


def serial_twin(kind: str, global_batch: int, steps: int, model=None, data=None):
    """The same optimizer on one process over the whole global batch: losses, norms, weights
    (default: the dp parity GPT and tokens)."""
    model = make_model() if model is None else model
    opt = CLASSES[kind](model.parameters(), **PARAMS[kind])
    data = make_tokens(global_batch) if data is None else data
    losses, norms, coefs = [], [], []
    for step in range(steps):
        batch = data[step * global_batch:(step + 1) * global_batch]
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()))
        coef = min(1.0, CLIP / (norm + 1e-6))
        for p in model.parameters():
            p.grad.mul_(coef)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        norms.append(norm)
        coefs.append(coef)
    return losses, norms, coefs, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(engine, mesh, micro: int, gas: int, first: int, last: int, poison: tuple[int, int] | None = None):
    """Steps first..last-1 on this rank's micro-batches; per step: loss, norm, bus bytes sent,
    whether it was skipped. `poison` = (step, dp rank) whose loss is made NaN."""
    global_batch = micro * gas * mesh.dp_size
    data = make_tokens(global_batch)
    out = []
    for step in range(first, last):
        before = sum(s.bus_bytes for s in engine.comms_logger.totals().values())
        for k in range(gas):
            start = step * global_batch + (mesh.dp_rank * gas + k) * micro
            batch = data[start:start + micro]
            loss = engine(batch[:, :-1], batch[:, 1:])
            if poison == (step, mesh.dp_rank):
                loss = loss * float("nan")
            engine.backward(loss)
            engine.step()
        sent = sum(s.bus_bytes for s in engine.comms_logger.totals().values()) - before
        out.append((engine.last_loss, engine.get_global_grad_norm(), sent, engine.last_step_overflowed))
    return out


def weights(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}


def run_parallel(kind: str, micro: int, gas: int):
    mesh = cached_mesh()
    engine, _, _, _ = trident.initialize(model=make_model(), config=config(kind, micro, gas), mesh=mesh)
    warm = train(engine, mesh, micro, gas, 0, WARMUP)
    warm_weights = weights(engine)
    rest = train(engine, mesh, micro, gas, WARMUP, STEPS)
    return warm + rest, warm_weights


@pytest.mark.parametrize("kind", list(CLASSES))
@pytest.mark.parametrize("world,micro,gas", [(2, 2, 2), (4, 2, 1)])
def test_warmup_equals_twin_then_wire_bytes_drop(kind, world, micro, gas):
    losses, norms, coefs, ref_weights = serial_twin(kind, micro * gas * world, WARMUP)
    assert max(coefs) < 1.0, f"clipping inactive on some warm-up step: {coefs}"
    results = run_on_ranks(world, run_parallel, kind, micro, gas)
    mean = [sum(r[0][i][0] for r in results) / world for i in range(STEPS)]
    assert_losses_close(mean[:WARMUP], losses, rtol=1e-5)
    for steps, warm_weights in results:
        assert_norms_close([s[1] for s in steps[:WARMUP]], norms, rtol=1e-6)
        assert_state_close(warm_weights, ref_weights, rtol=1e-5)
        full = steps[0][2]  # a warm-up step: the fp32 all-reduce of every gradient
        assert full > 0
        for step in COMPRESSED_STEPS[kind]:
            assert steps[step - 1][2] <= full / 16, (kind, step, steps[step - 1][2], full)
            assert math.isfinite(steps[step - 1][0])
    print(f"\n{kind} dp={world}: bus bytes per step {[round(s[2]) for s in results[0][0]]}, losses "
          f"{[round(x, 4) for x in mean]}")


SAVE_AFTER = {"OneBitAdam": 6, "OneBitLamb": 6, "ZeroOneAdam": 9}
"""Steps before the checkpoint: in the compressed phase; for 0/1 Adam after a local step that did
not sync, so the replicas differ when it is saved."""


def run_resume(kind: str, micro: int, gas: int, folder: str):
    """Train SAVE_AFTER[kind] steps, save, go on to STEPS; then a fresh engine loads the
    checkpoint and trains the same steps."""
    mesh = cached_mesh()
    engine, _, _, _ = trident.initialize(model=make_model(), config=config(kind, micro, gas), mesh=mesh)
    train(engine, mesh, micro, gas, 0, SAVE_AFTER[kind])
    at_save = weights(engine)
    engine.save_checkpoint(folder, tag="compressed")
    first = train(engine, mesh, micro, gas, SAVE_AFTER[kind], STEPS)
    first_weights = weights(engine)
    torch.manual_seed(123)  # a different start: everything must come from the checkpoint
    other, _, _, _ = trident.initialize(model=GPT(GPTConfig(**MODEL)), config=config(kind, micro, gas), mesh=mesh)
    other.load_checkpoint(folder, tag="compressed")
    second = train(other, mesh, micro, gas, SAVE_AFTER[kind], STEPS)
    return [s[0] for s in first], first_weights, [s[0] for s in second], weights(other), at_save


@pytest.mark.parametrize("kind", list(CLASSES))
@pytest.mark.parametrize("world", [2, 4])
def test_resume_in_compressed_phase_continues_identically(world, kind, tmp_path):
    results = run_on_ranks(world, run_resume, kind, 2, 1, str(tmp_path))
    for losses, w, resumed_losses, resumed_w, _ in results:
        assert resumed_losses == losses
        for name in w:
            assert torch.equal(resumed_w[name], w[name]), name
    replicas_differ = any(not torch.equal(results[0][4][n], results[1][4][n]) for n in results[0][4])
    assert replicas_differ == (kind == "ZeroOneAdam")  # local steps: each rank's own parameters were saved


def run_poisoned(micro: int):
    mesh = cached_mesh()
    cfg = config("OneBitAdam", micro, 1) | {"numerics": {"on_nonfinite": "skip"}}
    engine, _, _, _ = trident.initialize(model=make_model(), config=cfg, mesh=mesh)
    steps = train(engine, mesh, micro, 1, 0, 8, poison=(6, 1))
    return [s[3] for s in steps], weights(engine)


def test_nonfinite_gradient_on_one_rank_skips_the_compressed_step_everywhere():
    results = run_on_ranks(2, run_poisoned, 2)
    for skipped, _ in results:
        assert skipped == [False] * 6 + [True, False]
    assert_state_close(results[1][1], results[0][1], rtol=0.0)


def run_fp16(micro: int):
    from trident.testing.parity import precision_sections
    mesh = cached_mesh()
    cfg = config("OneBitAdam", micro, 1) | precision_sections("fp16")
    engine, _, _, _ = trident.initialize(model=make_model(), config=cfg, mesh=mesh)
    steps = train(engine, mesh, micro, 1, 0, STEPS)
    return [(s[3], s[2]) for s in steps], engine.optimizer.policy["step"], weights(engine)


def test_fp16_overflow_skips_count_out_of_the_warmup_on_every_rank():
    """fp16 from a loss scale too high: the first steps overflow and are skipped on both ranks;
    skipped steps do not count toward freeze_step (DeepSpeed skips the optimizer step too), so
    compression starts after freeze_step *applied* steps."""
    results = run_on_ranks(2, run_fp16, 2)
    (steps, applied, _), (other_steps, _, _) = results
    assert [s[0] for s in steps] == [s[0] for s in other_steps]
    skipped = sum(s[0] for s in steps)
    assert 0 < skipped < STEPS - PARAMS["OneBitAdam"]["freeze_step"]
    assert applied == STEPS - skipped
    full = max(s[1] for s in steps)  # a warm-up step's gradient all-reduce (fp16 here, so 1/16 is the bound)
    applied_before = 0
    for was_skipped, sent in steps:
        compressed = applied_before >= PARAMS["OneBitAdam"]["freeze_step"]
        if not was_skipped:
            assert (sent < full / 8) == compressed, (steps, applied_before)
            applied_before += 1
    assert_state_close(results[1][2], results[0][2], rtol=0.0)


def run_tp(kind: str, micro: int):
    """dp 2 x tp 2: each tp rank compresses the momentum of its own shards over its dp group."""
    from trident.tensor_parallel import shard_specs
    mesh = cached_mesh(tp=2)
    cfg = config(kind, micro, 1) | {"tensor_parallel": {"size": 2}}
    engine, _, _, _ = trident.initialize(model=make_model(), config=cfg, mesh=mesh)
    def step_all_reduce_bytes(first: int, last: int) -> list:
        out = []
        for step in range(first, last):
            before = engine.comms_logger.totals().get("all_reduce")
            before = before.bus_bytes if before else 0.0
            out.append(train(engine, mesh, micro, 1, step, step + 1)[0])
            after = engine.comms_logger.totals()["all_reduce"].bus_bytes
            out[-1] = (*out[-1], after - before)
        return out

    warm = step_all_reduce_bytes(0, WARMUP)
    warm_weights = weights(engine)
    rest = step_all_reduce_bytes(WARMUP, STEPS)
    # tp's activation all-reduces are the same every step; a compressed step's all-reduces are
    # tp's plus the 4-byte finite check, so the dp traffic of any step is what exceeds them
    tp_bytes = min(s[4] for s in rest)
    dp_bytes = [s[2] - tp_bytes for s in warm + rest]
    return [(s[0], s[1], b, s[3]) for s, b in zip(warm + rest, dp_bytes)], warm_weights, weights(engine), \
        shard_specs(engine.module), mesh.dp_rank, mesh.tp_rank


@pytest.mark.parametrize("kind", ["OneBitAdam", "OneBitLamb"])
def test_tensor_parallel_warmup_equals_twin_and_dp_replicas_stay_equal(kind):
    """Under tp the norm for clipping is reduced over the tp group in both phases, so warm-up
    equals the one-process twin (merged shards, clipping active); in the compressed phase every
    dp replica of a shard takes the same averaged-momentum step, so replicas stay bit-equal,
    and the bytes drop as on plain dp. (1-bit LAMB's trust ratios are per shard under tp, as in
    DeepSpeed with Megatron's tp: its warm-up is compared for OneBitAdam only.)"""
    from trident.tensor_parallel import merge_state_dicts
    micro = 4
    losses, _, coefs, ref_weights = serial_twin(kind, micro * 2, WARMUP)
    assert max(coefs) < 1.0
    results = run_on_ranks(4, run_tp, kind, micro)
    by_dp = {}
    for steps, warm, final, specs, dp_rank, tp_rank in results:
        by_dp.setdefault(dp_rank, {})[tp_rank] = (steps, warm, final, specs)
    mean = [sum(by_dp[d][0][0][i][0] for d in by_dp) / 2 for i in range(STEPS)]
    for d, per_tp in by_dp.items():
        assert [s[0] for s in per_tp[0][0]] == [s[0] for s in per_tp[1][0]]  # tp ranks agree on the loss
        if kind == "OneBitAdam":
            merged = merge_state_dicts([per_tp[t][1] for t in (0, 1)], per_tp[0][3])
            assert_state_close(merged, ref_weights, rtol=1e-5)
    if kind == "OneBitAdam":
        assert_losses_close(mean[:WARMUP], losses, rtol=1e-5)
    for t in (0, 1):
        assert_state_close(by_dp[1][t][2], by_dp[0][t][2], rtol=0.0)
        full = by_dp[0][t][0][0][2]  # a warm-up step's gradient all-reduce, tp's traffic taken out
        assert full > 0
        for step in COMPRESSED_STEPS[kind]:
            assert 0 < by_dp[0][t][0][step - 1][2] <= full / 16, (kind, step)


PP_GLOBAL, PP_MICRO = 8, 2


def run_pp(kind: str):
    """pp 2 x dp 2, 1F1B: each stage compresses the momentum of its own layers over its dp group."""
    from trident.models.gpt import GPTConfig as Cfg
    from trident.models.gpt_pipe import gpt_pipe, gpt_state_dict, load_gpt_state_dict
    from tests.parity.test_pp_equivalence import MODEL as PP_MODEL, make_gpt, make_tokens as pp_tokens, pipe_steps
    mesh = cached_mesh(pp=2)
    cfg = Cfg(**PP_MODEL)
    pipe = gpt_pipe(cfg, 2, partition_method="uniform", stage_id=mesh.pp_rank, mesh=mesh)
    load_gpt_state_dict(pipe, make_gpt().state_dict(), cfg)
    gas = PP_GLOBAL // (PP_MICRO * mesh.dp_size)
    conf = config(kind, PP_MICRO, gas) | {"pipeline": {"stages": 2, "schedule": "1f1b",
                                                       "partition_method": "uniform"}}
    engine, *_ = trident.initialize(model=pipe, config=conf, mesh=mesh)
    data = pp_tokens(PP_GLOBAL)
    sent = []

    def dp_bus_bytes() -> float:  # the stage's sends and receives of activations left out
        return sum(s.bus_bytes for op, s in engine.comms_logger.totals().items() if op not in ("send", "recv"))

    for step in range(STEPS):
        before = dp_bus_bytes()
        losses, _ = pipe_steps(engine, mesh, data[step * PP_GLOBAL:], 1, PP_MICRO, PP_GLOBAL)
        sent.append((losses[0], dp_bus_bytes() - before))
        if step == WARMUP - 1:
            warm = {k: v.detach().clone() for k, v in gpt_state_dict(pipe, cfg).items()}
    final = {k: v.detach().clone() for k, v in gpt_state_dict(pipe, cfg).items()}
    return sent, warm, final, mesh.pp_rank, mesh.dp_rank


def test_pipeline_warmup_equals_twin_and_dp_replicas_stay_equal():
    """OneBitAdam under pp 2 x dp 2 (1F1B, 2 micro-batches per rank): warm-up equals the one-
    process twin (each stage's weights, clipping active, its norm over both stages); afterwards
    each stage's dp replicas stay bit-equal and the stage's dp bytes drop to 1/16 or less."""
    from tests.parity.test_pp_equivalence import make_gpt, make_tokens as pp_tokens
    losses, _, coefs, ref = serial_twin("OneBitAdam", PP_GLOBAL, WARMUP, make_gpt(), pp_tokens(PP_GLOBAL))
    assert max(coefs) < 1.0
    results = run_on_ranks(4, run_pp, "OneBitAdam")
    by = {(r[3], r[4]): r for r in results}
    last_stage = [by[(1, d)][0] for d in (0, 1)]
    mean = [sum(s[i][0] for s in last_stage) / 2 for i in range(STEPS)]
    assert_losses_close(mean[:WARMUP], losses, rtol=1e-5)
    for stage in (0, 1):
        assert by[(stage, 0)][1] and all(name in ref for name in by[(stage, 0)][1])
        assert_state_close(by[(stage, 0)][1], {k: ref[k] for k in by[(stage, 0)][1]}, rtol=1e-5)
        assert_state_close(by[(stage, 1)][2], by[(stage, 0)][2], rtol=0.0)
        sent = by[(stage, 0)][0]
        full = sent[0][1]
        assert full > 0
        for step in COMPRESSED_STEPS["OneBitAdam"]:
            assert 0 < sent[step - 1][1] <= full / 16, (stage, step, sent[step - 1][1], full)
