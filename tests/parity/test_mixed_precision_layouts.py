"""bf16, and fp16 with dynamic loss scaling, under tensor, pipeline, 3D (pp x dp x tp) and
parameter-server layouts: every layout's 16-bit run tracks fp32 serial training.

"Tracks" is what the data-parallel and ZeRO mixed-precision tests check, plus a check on the
weights that the losses cannot replace:

* losses: every step within 2% of fp32 serial training on the same batches. On these batches
  of random tokens the fp32 loss hardly moves (it stays within 1% of ln 61 for 20 steps), so a
  run that never updates its weights passes this too;
* weights: the 16-bit run ends close to the fp32 run relative to how far training moved the
  weights, ||w16 - w32|| <= DRIFT ||w32 - w0|| over all tensors (the servers' fp32 masters for
  a parameter server). A run that never updated is off by 100%; an fp16 AdamW run that leaves
  the clipped gradient multiplied by the loss scale by 24-35%, with losses within 0.4%;
* the ranks of one layout agree exactly: the same loss on every rank that reports the batch's
  loss, the same skipped steps and loss scale, tp-replicated tensors bit-equal
  (`merge_state_dicts` checks) and data-parallel replicas bit-equal;
* fp16: the dynamic scale starts at 2**21 (`precision_sections`), above what these gradients
  fit in fp16, so the first step overflows; every overflowing step is skipped on every rank
  alike and halves the scale (hysteresis 1), and fewer than half of the steps are skipped (a
  later one may overflow again as the gradients grow). The fp32 reference of an fp16 run skips
  the same steps (`train_serial(skip=...)`): it records their loss and does not update.

Each layout runs with AdamW and, except 2x2x2, with SGD + momentum: AdamW is blind to the scale
of a gradient, SGD is not (a gradient left multiplied by the loss scale makes it diverge).

Where an exactly equivalent 16-bit run exists it must agree to fp32 rounding (rtol 1e-5): a
sync parameter server with 2 workers against 1 worker accumulating the same 2 micro-batches
(halving a loss is exact in any float format, and the gradients are summed in fp32), and the
servers' fp32 masters rounded to bf16 against the workers' weights (bit-equal). tp=2 against
tp=1 is not such a pair (the row-parallel layers sum partial products in another order), nor
is pp=2 against one stage (the tied embedding's two gradients are summed in fp32 across stages
but in 16 bits within one).

fp16 under sync parameter servers: the workers push gradients of the scaled loss with the scale;
the servers unscale, clip by the global norm and skip an overflowing round for every worker
alike (the workers hold the servers' fp32 masters in fp16, bit for bit). Async mode refuses fp16:
each worker's update is applied alone, so an overflow cannot be skipped consistently.

`test_tied_copy_keeps_its_tp_split_through_a_cast` pins a bug the 2x2x2 run found: casting a
pipeline stage to bf16/fp16 dropped the tensor-parallel marks of its copy of the tied
embedding (a buffer), so it looked replicated.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import trident
from trident.testing.distributed import run_on_ranks
from trident.testing.parity import FP16_INITIAL_SCALE_POWER, assert_losses_close, assert_state_close, train_serial
from trident.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec
from trident.tensor_parallel import ShardSpec, merge_state_dicts, shard_specs
from trident.tensor_parallel.layers import set_tp_attributes
from tests.parity import test_3d_equivalence as three_d
from tests.parity import test_dp_equivalence as dp
from tests.parity import test_pp_equivalence as pp
from tests.parity import test_ps_equivalence as ps
from tests.parity.test_3d_equivalence import train_3d
from tests.parity.test_pp_equivalence import train_pp
from tests.parity.test_ps_equivalence import run_ps
from tests.parity.test_tp_engine import train_gpt

LOSS_RTOL = 2e-2
# ||w16 - w32|| / ||w32 - w0||: measured at most 0.063 (pp=2 bf16 AdamW; 0.08 for the same model on
# one stage), 0.015 with SGD. fp16 with AdamW that forgets to unscale the clipped gradient lands at
# 0.24-0.35 (its losses stay within 0.4% of fp32); with SGD it diverges.
DRIFT = 0.15
INITIAL_SCALE = 2.0 ** FP16_INITIAL_SCALE_POWER
CLIP = 0.05  # active on most steps: fp16 must clip the unscaled gradient


# -- on every rank --------------------------------------------------------------------------------

def traced(fn, *args):
    """Runs on every rank: `fn(*args)`, and (loss scale, skipped steps) of the engine it built
    through trident.initialize (None on a rank that built none, e.g. a parameter server)."""
    engines = []
    initialize = trident.initialize

    def recording(*a, **k):
        out = initialize(*a, **k)
        engines.append(out[0])
        return out

    trident.initialize = recording
    try:
        result = fn(*args)
    finally:
        trident.initialize = initialize
    scaling = (float(engines[-1].loss_scale), int(engines[-1].skipped_steps)) if engines else None
    return result, scaling


# -- references -----------------------------------------------------------------------------------

MODULES = {"dp": (dp, dp.make_model), "pp": (pp, pp.make_gpt)}


@functools.lru_cache(maxsize=None)
def fp32_reference(model: str, optimizer: str, global_batch: int, steps: int, skipped: tuple[int, ...]):
    """fp32 serial training (clipping at CLIP) on `steps` global batches of the model's parity
    test, the steps in `skipped` skipped: (losses, final weights, initial weights)."""
    module, make = MODULES[model]
    tokens = module.make_tokens(global_batch)[:steps * global_batch]
    net = make()
    initial = {k: v.detach().clone() for k, v in net.state_dict().items()}
    run = train_serial(net, [(b[:, :-1], b[:, 1:]) for b in tokens.split(global_batch)], optimizer,
                       module.OPT_LR[optimizer], CLIP, skip=skipped)
    return run.losses, run.weights, initial


def drift(weights: dict, ref: dict, initial: dict) -> float:
    """||w - ref|| / ||ref - initial|| over every tensor of `weights`."""
    num = sum(float((weights[k].double() - ref[k].double()).square().sum()) for k in weights)
    den = sum(float((ref[k].double() - initial[k].double()).square().sum()) for k in weights)
    return math.sqrt(num / den)


# -- checks ---------------------------------------------------------------------------------------

def skipped_steps(precision: str, norms_per_rank: list[list], scalings: list[tuple]) -> tuple[int, ...]:
    """Every rank skipped the same steps (a step's norm is None when it was skipped) and holds
    the same scale. bf16 skips none. fp16 skips the first step (the scale starts too high), then
    fewer than half of the steps in all (a later step may overflow again as the gradients grow),
    and each skip halved the scale. Returns the skipped steps (0-based)."""
    patterns = {tuple(i for i, n in enumerate(norms) if n is None) for norms in norms_per_rank}
    assert len(patterns) == 1, f"ranks skipped different steps: {patterns}"
    assert len(set(scalings)) == 1, f"ranks disagree on (loss scale, skipped steps): {scalings}"
    skipped, (scale, count), steps = patterns.pop(), scalings[0], len(norms_per_rank[0])
    assert len(skipped) == count
    if precision == "bf16":
        assert count == 0 and scale == 1.0
    else:
        assert skipped[:1] == (0,) and count < steps // 2, f"fp16 skipped steps {skipped} of {steps}"
        assert scale == INITIAL_SCALE / 2 ** count
    return skipped


def check_tracks_fp32(losses: list[float], weights: dict, model: str, optimizer: str, global_batch: int,
                      skipped: tuple[int, ...], label: str) -> None:
    ref_losses, ref_weights, initial = fp32_reference(model, optimizer, global_batch, len(losses), skipped)
    assert all(math.isfinite(x) for x in losses)
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert_losses_close(losses, ref_losses, rtol=LOSS_RTOL)
    worst = max(abs(a - b) / b for a, b in zip(losses, ref_losses))
    d = drift(weights, ref_weights, initial)
    print(f"\n{label}: skipped {skipped}, worst loss rel diff vs fp32 {worst:.2e}, weight drift {d:.3f}")
    assert d <= DRIFT, f"{label}: weights drifted {d:.3f} of the fp32 displacement from the fp32 run"


def merged_replicas(results) -> list[dict]:
    """Pipeline results (losses, weights, specs, (pp, dp, tp), norms, ...): the full state dict of
    every data-parallel replica (stages joined, tp shards merged)."""
    shards: dict[int, dict[int, dict[int, tuple]]] = {}
    for _, weights, specs, (p, d, t), *_ in results:
        shards.setdefault(d, {}).setdefault(p, {})[t] = (weights, specs)
    replicas = []
    for d in sorted(shards):
        full = {}
        for stage in shards[d].values():
            ranks = [stage[t] for t in sorted(stage)]
            merged = merge_state_dicts([w for w, _ in ranks], ranks[0][1]) if len(ranks) > 1 else ranks[0][0]
            for name in merged.keys() & full.keys():  # the tied embedding, on the first and the last stage
                assert torch.equal(merged[name], full[name]), f"the stages hold different {name}"
            full.update(merged)
        replicas.append(full)
    return replicas


def check_pipeline(results, precision: str, optimizer: str, global_batch: int, label: str) -> None:
    """A pipelined run (pp, or pp x dp x tp): every rank reports the batch's loss."""
    outputs = [r for r, _ in results]
    assert len({tuple(r[0]) for r in outputs}) == 1, "ranks report different losses"
    skipped = skipped_steps(precision, [r[4] for r in outputs], [s for _, s in results])
    replicas = merged_replicas(outputs)
    for other in replicas[1:]:
        assert all(torch.equal(other[k], replicas[0][k]) for k in replicas[0]), "dp replicas differ"
    check_tracks_fp32(outputs[0][0], replicas[0], "pp", optimizer, global_batch, skipped, label)


# -- tests ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_tp2_tracks_fp32(precision, optimizer):
    """The plain GPT split over 2 tensor-parallel ranks by config, micro-batch 8 on each."""
    results = run_on_ranks(2, traced, train_gpt, 2, 0, 8, CLIP, False, optimizer, precision)
    outputs = [r for r, _ in results]
    assert outputs[0][0] == outputs[1][0], "tp ranks report different losses"
    skipped = skipped_steps(precision, [r[5] for r in outputs], [s for _, s in results])
    merged = merge_state_dicts([r[1] for r in outputs], outputs[0][2])
    check_tracks_fp32(outputs[0][0], merged, "dp", optimizer, 8, skipped, f"tp=2 {precision} {optimizer}")


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_pp2_tracks_fp32(precision, optimizer):
    """The pipelined GPT on 2 stages (tied embedding across them), 1F1B over 4 micro-batches."""
    results = run_on_ranks(2, traced, train_pp, 2, "1f1b", 1, 4, CLIP, 0, 1, optimizer, precision)
    check_pipeline(results, precision, optimizer, pp.MICRO * 4, f"pp=2 {precision} {optimizer}")


@pytest.mark.eight_ranks
def test_2x2x2_bf16_and_fp16_track_fp32():
    """pp 2 x dp 2 x tp 2 with ZeRO-1, 1F1B, sequence parallelism and activation checkpointing."""
    for precision in ("bf16", "fp16"):
        results = run_on_ranks(8, traced, train_3d, 2, 2, True, True, "adamw", precision, timeout=600)
        check_pipeline(results, precision, "adamw", three_d.GLOBAL, f"2x2x2 {precision}")


def ps_roles(results) -> tuple[list, list]:
    """(workers' results, servers' results); each worker's loss scale is 1 and it skipped nothing."""
    assert all(scaling == (1.0, 0) for r, scaling in results if r["role"] == "worker")
    return [r for r, _ in results if r["role"] == "worker"], [r for r, _ in results if r["role"] == "server"]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_sync_ps_bf16_tracks_fp32_and_matches_accumulation(optimizer):
    """1 server, 2 bf16 workers x micro-batch 4: against 1 worker accumulating the same 2
    micro-batches (rtol 1e-5), and fp32 serial training."""
    workers, servers = ps_roles(run_on_ranks(3, traced, run_ps, 1, 4, 1, CLIP, "balanced", optimizer, "bf16"))
    (alone,), _ = ps_roles(run_on_ranks(2, traced, run_ps, 1, 4, 2, CLIP, "balanced", optimizer, "bf16"))
    mean = [sum(s) / len(s) for s in zip(*(w["losses"] for w in workers))]
    assert_losses_close(mean, alone["losses"], rtol=1e-5)
    held = servers[0]["params"]
    for w in workers:
        # the weights a worker holds are the servers' fp32 masters rounded to bf16
        for name, master in held.items():
            assert torch.equal(w["weights"][name], master.to(torch.bfloat16).float()), name
        assert_state_close(w["weights"], alone["weights"], rtol=1e-5)
    ref = ps.serial_reference(8, CLIP, optimizer)
    assert_losses_close(mean, ref.losses, rtol=LOSS_RTOL)
    # the fp32 masters: with SGD at the schedule's lr (3e-3) the run moves the weights less than
    # bf16 resolves, so the workers' bf16 copies sit ~1.7x the displacement away from fp32
    d = drift(held, ref.weights, {k: v.detach() for k, v in ps.make_model().state_dict().items()})
    worst = max(abs(a - b) / b for a, b in zip(mean, ref.losses))
    print(f"\nps bf16 {optimizer}: worst loss rel diff vs fp32 {worst:.2e}, weight drift {d:.3f}")
    assert d <= DRIFT


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_sync_ps_fp16_skips_overflows_alike_and_tracks_fp32(optimizer):
    """1 server, 2 fp16 workers: the servers unscale by the pushed loss scale, clip by the global
    norm and skip a round whose gradient overflowed, so every worker's scaler moves alike."""
    results = run_on_ranks(3, traced, run_ps, 1, 4, 1, CLIP, "balanced", optimizer, "fp16")
    workers = [(r, s) for r, s in results if r["role"] == "worker"]
    server = next(r for r, _ in results if r["role"] == "server")
    skipped = skipped_steps("fp16", [r["norms"] for r, _ in workers], [s for _, s in workers])
    mean = [sum(s) / len(s) for s in zip(*(w["losses"] for w, _ in workers))]
    ref = ps.serial_reference(8, CLIP, optimizer, skip=skipped)
    assert_losses_close(mean, ref.losses, rtol=LOSS_RTOL)
    held = server["params"]
    for w, _ in workers:
        for name, master in held.items():  # the workers hold the servers' fp32 masters in fp16
            assert torch.equal(w["weights"][name], master.to(torch.float16).float()), name
    d = drift(held, ref.weights, {k: v.detach() for k, v in ps.make_model().state_dict().items()})
    worst = max(abs(a - b) / b for a, b in zip(mean, ref.losses))
    print(f"\nps fp16 {optimizer}: skipped {skipped}, worst loss rel diff vs fp32 {worst:.2e}, weight drift {d:.3f}")
    assert d <= DRIFT


def test_tied_copy_keeps_its_tp_split_through_a_cast():
    """A stage's copy of a weight tied to an earlier stage is a buffer; `.to(bf16)` (what
    trident.initialize does) replaces buffers by new tensors, which must stay marked as split."""
    class Table(torch.nn.Embedding):
        def __init__(self):
            super().__init__(8, 4)
            set_tp_attributes(self.weight, ShardSpec(dim=0, full_size=16, tp_size=2))

    layers = [TiedLayerSpec("embed", Table), LayerSpec(torch.nn.Linear, 4, 4),
              TiedLayerSpec("embed", Table, forward_fn=lambda table, x: x @ table.weight.t())]
    last = PipelineModule(layers, num_stages=2, stage_id=1, partition_method="uniform")
    expected = {"tied_modules.embed.weight": ShardSpec(dim=0, full_size=16, tp_size=2)}
    assert shard_specs(last) == expected
    for dtype in (torch.bfloat16, torch.float16):
        last.to(dtype)
        assert last.get_buffer("tied_modules.embed.weight").dtype == dtype
        assert shard_specs(last) == expected
