"""Expert parallelism trains to the same losses and weights as one process holding every
expert with the same router (fp32, rtol 1e-5).

The serial reference is plain PyTorch: the MoE GPT with all experts, one forward over the whole
global batch per step. The parallel runs put E / ep experts on each ep rank; every rank feeds
its own micro-batch (data rank = dp x ep + ep, the order routing's priority follows), and the
router's capacity is counted over the whole micro-step's token set, so the same tokens are
dropped as in the one-process run (trident.moe.routing). Weights are compared per rank: the
dense ones and the experts that rank holds, every expert covered by some rank.
"""

from __future__ import annotations

import functools

import pytest
import torch

import trident
from trident.models.gpt import GPT, GPTConfig
from trident.tensor_parallel import merge_state_dicts, shard_specs
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.parity import (SerialRun, assert_losses_close, assert_norms_close, assert_state_close,
                                    optimizer_section, train_serial)

STEPS = 8
MODEL = dict(vocab_size=61, seq_len=16, n_layer=2, n_head=2, d_model=32, dropout=0.0, bias=False)
OPT_LR = {"adamw": 3e-3, "sgd": 0.5, "muon": 3e-3}
SGD_CLIP = 0.05  # below the gradient norm on every step
# AdamW weights at 5e-5: Adam divides each element's step by its own gradient's size, so elements
# whose gradient is near zero turn rounding differences (an expert's batch summed from two ranks'
# rows, tokens combined in another order) into visible steps. SGD with active clipping, which
# exposes any scaling error, holds 1e-5 for weights and 1e-6 for the global norm.
WEIGHT_RTOL = {"adamw": 5e-5, "sgd": 1e-5, "muon": 1e-5}
NO_DROP = 8.0    # capacity_factor with room for every token on one expert: nothing drops


def moe_spec(experts: int, k: int, capacity_factor: float, drop: bool = True, every: int = 1) -> dict:
    return dict(num_experts=experts, k=k, every_n_layers=every, capacity_factor=capacity_factor, min_capacity=0,
                drop_tokens=drop, aux_loss_coef=0.01, z_loss_coef=0.001)


def make_model(spec: dict) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**MODEL, moe=spec))


def make_tokens(global_batch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, MODEL["vocab_size"], (STEPS * global_batch, MODEL["seq_len"] + 1), generator=g)


def config(micro: int, clip: float, optimizer: str, stage: int = 0, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
            "optimizer": optimizer_section(optimizer, OPT_LR[optimizer]), "gradient_clipping": clip,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 5000}, "steps_per_print": 0, **extra}


@functools.lru_cache(maxsize=None)
def serial_reference(spec_items: tuple, global_batch: int, clip: float, optimizer: str) -> SerialRun:
    data = make_tokens(global_batch)
    batches = [(b[:, :-1], b[:, 1:]) for b in data.split(global_batch)]
    return train_serial(make_model(dict(spec_items)), batches, optimizer, OPT_LR[optimizer], clip)


def data_rank(mesh) -> tuple[int, int]:
    return mesh.dp_rank * mesh.ep_size + mesh.ep_rank, mesh.dp_size * mesh.ep_size


def train_ep(spec: dict, ep: int, micro: int, clip: float, optimizer: str, tp: int = 1, stage: int = 0):
    """Runs on every rank: trident with expert parallelism ep (dp takes the rest of the world)."""
    mesh = cached_mesh(tp=tp, ep=ep)
    extra = {"tensor_parallel": {"size": tp}} if tp > 1 else {}
    engine, _, _, _ = trident.initialize(model=make_model(spec), config=config(micro, clip, optimizer, stage, **extra),
                                         mesh=mesh)
    rank, size = data_rank(mesh)
    data = make_tokens(micro * size)
    losses, norms, dropped = [], [], []
    for step in range(STEPS):
        start = step * micro * size + rank * micro
        batch = data[start:start + micro]
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))
        engine.step()
        losses.append(engine.last_loss)
        norms.append(engine.get_global_grad_norm())
        dropped.append(engine.module.blocks[-1].mlp.load_stats()["dropped_share"])
        if step == 0:  # the first step's kept (expert, token) pairs, tokens numbered globally
            r = engine.module.blocks[-1].mlp.last_routing
            first = kept_pairs(r, rank * micro * MODEL["seq_len"])
    state = engine.consolidated_state_dict() if stage == 3 else engine.module.state_dict()
    weights = {k: v.detach().float().clone() for k, v in state.items()}
    if tp > 1:  # whole tensors from the tp slices, as one process holds them
        per_tp: list = [None] * mesh.tp_size
        torch.distributed.all_gather_object(per_tp, weights, group=mesh.tp_group)
        weights = merge_state_dicts(per_tp, shard_specs(engine.module))
    return losses, weights, norms, dropped, first


def kept_pairs(r, offset: int = 0) -> set[tuple[int, int]]:
    return {(e, t + offset) for e, t in zip(r.experts.tolist(), r.tokens.tolist())}


def mean_losses(results) -> list[float]:
    """Each data rank's loss once (tp ranks of one data rank report the same loss)."""
    return [sum(step) / len(step) for step in zip(*[r[0] for r in results])]


def check_weights(results, ref: SerialRun, rtol: float = 1e-5) -> None:
    covered = set()
    for _, weights, *_ in results:
        assert set(weights) <= set(ref.weights), sorted(set(weights) - set(ref.weights))
        assert_state_close(weights, {n: ref.weights[n] for n in weights}, rtol=rtol)
        covered |= set(weights)
    assert covered == set(ref.weights), sorted(set(ref.weights) - covered)


def run_case(world: int, spec: dict, ep: int, micro: int, clip: float, optimizer: str, **kw):
    ref = serial_reference(tuple(sorted(spec.items())), micro * world // kw.get("tp", 1), clip, optimizer)
    results = run_on_ranks(world, train_ep, spec, ep, micro, clip, optimizer, **kw)
    assert_losses_close(mean_losses(results), ref.losses, rtol=1e-5)
    check_weights(results, ref, WEIGHT_RTOL[optimizer])
    if clip:
        assert max(ref.clip_coefs) < 1.0, f"clipping inactive on some step: {ref.clip_coefs}"
        for r in results:
            assert_norms_close(r[2], ref.norms, rtol=1e-6)
    return results


@pytest.mark.parametrize("experts,k,optimizer,clip", [
    (4, 1, "adamw", 0.0),
    (4, 2, "adamw", 0.0),
    (4, 2, "sgd", SGD_CLIP),
    (8, 1, "sgd", SGD_CLIP),
    (8, 2, "adamw", 0.0),
])
def test_ep2_matches_one_process(experts, k, optimizer, clip):
    results = run_case(2, moe_spec(experts, k, NO_DROP), 2, 4, clip, optimizer)
    assert all(d == 0.0 for r in results for d in r[3])


@pytest.mark.parametrize("k,optimizer,clip", [(1, "sgd", SGD_CLIP), (2, "adamw", 0.0), (2, "sgd", SGD_CLIP)])
def test_ep4_matches_one_process(k, optimizer, clip):
    run_case(4, moe_spec(8, k, NO_DROP), 4, 2, clip, optimizer)


@pytest.mark.parametrize("k", [1, 2])
def test_ep2_drops_the_same_tokens_as_one_process(k):
    """capacity_factor 1: experts overflow and drop; the losses and weights still match, which
    needs the same (token, expert) pairs dropped as in the one-process run."""
    spec = moe_spec(4, k, 1.0)
    results = run_case(2, spec, 2, 4, SGD_CLIP, "sgd")
    ref_model = make_model(spec)
    data = make_tokens(8)[:8]
    ref_model(data[:, :-1], data[:, 1:])
    expected = ref_model.blocks[-1].mlp.load_stats()["dropped_share"]
    assert expected > 0
    for r in results:
        assert r[3][0] == pytest.approx(expected)  # the first step's routing, before any update
    kept = set().union(*(r[4] for r in results))
    assert kept == kept_pairs(ref_model.blocks[-1].mlp.last_routing)  # the same (expert, token) pairs


def test_ep2_dropless_matches_one_process():
    run_case(2, moe_spec(4, 2, 1.0, drop=False), 2, 4, SGD_CLIP, "sgd")


@pytest.mark.parametrize("stage", [2, 3])
def test_dp2_ep2_zero_matches_one_process(stage):
    """Dense weights partitioned over dp x ep (4 ranks), expert weights over dp (2 ranks); under
    stage 3 each expert's weights are gathered over its own group for its forward and backward."""
    run_case(4, moe_spec(4, 2, NO_DROP), 2, 2, SGD_CLIP, "sgd", stage=stage)


def test_dp2_ep2_stage0_matches_one_process():
    run_case(4, moe_spec(4, 1, 1.0), 2, 2, 0.0, "adamw")


@pytest.mark.parametrize("world,stage", [(2, 0), (4, 2), (4, 3)])
def test_muon_with_experts_matches_one_process(world, stage):
    """Muon on each expert's matrices, the router's and the dense ones (AdamW for the embeddings
    and norms), clipping active. Under ZeRO the experts' matrices go to owners in their own dp
    group, the dense ones to owners in dp x ep."""
    run_case(world, moe_spec(4, 2, NO_DROP), 2, 8 // world, SGD_CLIP, "muon", stage=stage)


def test_ep2_x_tp2_matches_one_process():
    """Attention and the dense block's MLP split over tp, the MoE block's experts whole on each
    tp rank (replicated over tp, split over ep)."""
    run_case(4, moe_spec(4, 2, NO_DROP, every=2), 2, 4, SGD_CLIP, "sgd", tp=2)


def train_pp(spec: dict, micro_batches: int, clip: float, optimizer: str, recompute: bool = False,
             schedule: str = "1f1b"):
    """Runs on every rank: the pipelined MoE GPT on 2 stages, one MoE block on each."""
    from trident.models.gpt_pipe import gpt_pipe, gpt_state_dict, load_gpt_state_dict
    mesh = cached_mesh(pp=2)
    cfg = GPTConfig(**MODEL, moe=spec)
    pipe = gpt_pipe(cfg, 2, partition_method="uniform", stage_id=mesh.pp_rank,
                    activation_checkpoint_interval=1 if recompute else 0)
    load_gpt_state_dict(pipe, make_model(spec).state_dict(), cfg)
    config_ = {**config(2, clip, optimizer), "gradient_accumulation_steps": micro_batches,
               "pipeline": {"stages": 2, "schedule": schedule, "partition_method": "uniform"}}
    engine, *_ = trident.initialize(model=pipe, config=config_, mesh=mesh)
    global_batch = 2 * micro_batches
    data = make_tokens(global_batch)
    losses, norms = [], []
    for step in range(STEPS):
        mine = data[step * global_batch:(step + 1) * global_batch]
        batches = [(mine[k:k + 2, :-1], mine[k:k + 2, 1:]) for k in range(0, global_batch, 2)]
        losses.append(float(engine.train_batch(iter(batches))))
        norms.append(engine.get_global_grad_norm())
    weights = {k: v.detach().float().clone() for k, v in gpt_state_dict(pipe, cfg).items()}
    return losses, weights, norms, [0.0], set()


def test_pp2_with_an_moe_block_per_stage_matches_one_process():
    """Two stages, each holding one MoE block. Without drops and without auxiliary losses (which
    are not linear in the batch) the micro-batches route and train as the whole batch."""
    spec = {**moe_spec(4, 2, NO_DROP), "aux_loss_coef": 0.0, "z_loss_coef": 0.0}
    ref = serial_reference(tuple(sorted(spec.items())), 8, SGD_CLIP, "sgd")
    results = run_on_ranks(2, train_pp, spec, 4, SGD_CLIP, "sgd")
    for losses, _, norms, *_ in results:
        assert_losses_close(losses, ref.losses, rtol=1e-5)
        assert_norms_close(norms, ref.norms, rtol=1e-6)
    check_weights(results, ref, WEIGHT_RTOL["sgd"])


class MicroBatched(torch.nn.Module):
    """The serial GPT over a whole global batch as gradient accumulation does it: the mean of
    each micro-batch's loss (its cross-entropy plus its own MoE auxiliary losses, which are not
    linear in the batch)."""

    def __init__(self, model: GPT, micro: int) -> None:
        super().__init__()
        self.model, self.micro = model, micro

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        losses = [self.model(x[k:k + self.micro], y[k:k + self.micro]) for k in range(0, len(x), self.micro)]
        return sum(losses[1:], losses[0]) / len(losses)


@pytest.mark.parametrize("recompute,schedule", [(False, "1f1b"), (True, "1f1b"), (False, "zb_h1")],
                         ids=["1f1b", "1f1b-checkpointed", "zb_h1"])
def test_pp2_carries_each_stage_aux_losses_like_one_process(recompute, schedule):
    """Two stages, one MoE block each, with load-balancing and z losses: each stage's auxiliary
    losses join its backward (and the reported loss) as one process's accumulated micro-batch
    losses do; with activation checkpointing they are attached again in the recomputed forward,
    and zero-bubble's deferred weight gradients include theirs. SGD + momentum with active
    clipping, losses and weights to 1e-5."""
    spec = moe_spec(4, 2, NO_DROP)
    assert spec["aux_loss_coef"] > 0 and spec["z_loss_coef"] > 0
    data = make_tokens(8)
    ref = train_serial(MicroBatched(make_model(spec), 2), [(b[:, :-1], b[:, 1:]) for b in data.split(8)], "sgd",
                       OPT_LR["sgd"], SGD_CLIP)
    ref.weights = {k.removeprefix("model."): v for k, v in ref.weights.items()}
    assert max(ref.clip_coefs) < 1.0
    without_aux = train_serial(MicroBatched(make_model({**spec, "aux_loss_coef": 0.0, "z_loss_coef": 0.0}), 2),
                               [(b[:, :-1], b[:, 1:]) for b in data.split(8)], "sgd", OPT_LR["sgd"], SGD_CLIP)
    assert abs(ref.losses[-1] - without_aux.losses[-1]) > 1e-4  # the aux losses matter here
    results = run_on_ranks(2, train_pp, spec, 4, SGD_CLIP, "sgd", recompute, schedule)
    for losses, _, norms, *_ in results:
        assert_losses_close(losses, ref.losses, rtol=1e-5)
        assert_norms_close(norms, ref.norms, rtol=1e-6)
    check_weights(results, ref, WEIGHT_RTOL["sgd"])


def train_then_save(spec: dict, ep: int, micro: int, path: str, steps: int, stage: int = 0):
    mesh = cached_mesh(ep=ep)
    engine, *_ = trident.initialize(model=make_model(spec), config=config(micro, SGD_CLIP, "sgd", stage), mesh=mesh)
    rank, size = data_rank(mesh)
    data = make_tokens(micro * size)
    for step in range(steps):
        start = step * micro * size + rank * micro
        batch = data[start:start + micro]
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))
        engine.step()
    engine.save_checkpoint(path)
    return engine.module.blocks[0].mlp.experts.first


def resume_and_train(spec: dict, ep: int, micro: int, path: str, first: int, stage: int = 0):
    mesh = cached_mesh(ep=ep)
    engine, *_ = trident.initialize(model=make_model(spec), config=config(micro, SGD_CLIP, "sgd", stage), mesh=mesh)
    engine.load_checkpoint(path)
    assert engine.global_steps == first
    rank, size = data_rank(mesh)
    data = make_tokens(micro * size)
    losses = []
    for step in range(first, STEPS):
        start = step * micro * size + rank * micro
        batch = data[start:start + micro]
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))
        engine.step()
        losses.append(engine.last_loss)
    weights = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    return losses, weights, [], [], set()


@pytest.mark.parametrize("stage,saved_ep", [(0, 4), (2, 4), (2, 2)])
def test_checkpoint_at_ep4_resumes_at_ep2(tmp_path, stage, saved_ep):
    """Experts are saved by global index: 4 ranks with 2 experts each write, 2 ranks with 4
    experts each read, and training continues with the losses of one uninterrupted process.
    Under ZeRO-2 the dense partitions are cut 4 ways and the experts' not at all (dp = 1); the
    reader puts every parameter's master and momentum back together by name. saved_ep 2: written
    by dp 2 x ep 2 (experts partitioned over dp), read by dp 1 x ep 2."""
    spec = moe_spec(8, 2, NO_DROP)
    ref = serial_reference(tuple(sorted(spec.items())), 8, SGD_CLIP, "sgd")
    firsts = run_on_ranks(4, train_then_save, spec, saved_ep, 2, str(tmp_path), 4, stage)
    assert firsts == ([0, 2, 4, 6] if saved_ep == 4 else [0, 4, 0, 4])
    from trident.checkpointing.consolidate import get_fp32_state_dict_from_zero_checkpoint
    whole = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))  # every expert, from 4 ep files
    assert {k: tuple(v.shape) for k, v in whole.items()} == {
        k: tuple(v.shape) for k, v in make_model(spec).state_dict().items()}
    results = run_on_ranks(2, resume_and_train, spec, 2, 4, str(tmp_path), 4, stage)
    assert_losses_close(mean_losses(results), ref.losses[4:], rtol=1e-5)
    check_weights(results, ref, WEIGHT_RTOL["sgd"])


@pytest.mark.eight_ranks
def test_dp2_ep4_zero1_with_drops_matches_one_process():
    """8 ranks: expert weights partitioned by ZeRO-1 over dp, dense ones over dp x ep; capacity
    counted over all eight ranks' tokens, so the drops are the one-process drops."""
    results = run_case(8, moe_spec(8, 1, 1.0), 4, 1, SGD_CLIP, "sgd", stage=1)
    assert max(r[3][0] for r in results) > 0  # tokens were dropped


def expert_bytes(spec: dict, ep: int, stage: int = 0):
    from trident.engine.build import _predicted_model_states
    mesh = cached_mesh(ep=ep)
    engine, *_ = trident.initialize(model=make_model(spec), config=config(2, 0.0, "adamw", stage), mesh=mesh)
    mine = sum(p.numel() * p.element_size() for n, p in engine.module.named_parameters() if ".experts." in n)
    batch = make_tokens(2)[:2]
    engine.backward(engine(batch[:, :-1], batch[:, 1:]))
    engine.step()
    return mine, engine.memory_breakdown(), _predicted_model_states(engine).as_dict()


@pytest.mark.parametrize("world,ep,stage", [(2, 2, 0), (4, 2, 2)])
def test_expert_bytes_per_rank_are_experts_over_ep(world, ep, stage):
    """Each rank holds exactly num_experts / ep experts; the planner's per-rank model states
    (dense over dp x ep, experts over dp) match what the strategy holds."""
    spec = moe_spec(4, 2, NO_DROP)
    whole = make_model(spec)
    experts = sum(p.numel() * 4 for n, p in whole.named_parameters() if ".experts." in n)
    dense = sum(p.numel() * 4 for n, p in whole.named_parameters() if ".experts." not in n)
    for mine, measured, predicted in run_on_ranks(world, expert_bytes, spec, ep, stage):
        assert mine == experts // ep
        if stage == 0:
            assert measured["parameters"] == dense + experts // ep
        for key, value in predicted.items():  # ZeRO pads partitions to whole shards: within 1%
            assert measured[key] == pytest.approx(value, rel=0.01), (key, measured, predicted)


def test_ep2_jitter_noise_is_drawn_as_one_process_draws_it():
    """noisy_gate_policy='Jitter': each layer draws the noise of the whole token set from its own
    seeded stream and keeps its rows, so ep ranks see the one-process noise."""
    run_case(2, {**moe_spec(4, 2, 1.0), "noisy_gate_policy": "Jitter"}, 2, 4, SGD_CLIP, "sgd")


def steps_with_csv(spec: dict, path: str):
    mesh = cached_mesh(ep=2)
    cfg = {**config(2, 0.0, "adamw"), "steps_per_print": 1,
           "csv_monitor": {"enabled": True, "output_path": path, "job_name": "moe"}}
    engine, *_ = trident.initialize(model=make_model(spec), config=cfg, mesh=mesh)
    data = make_tokens(4)
    rank, _ = data_rank(mesh)
    for step in range(2):
        batch = data[step * 4 + rank * 2:][:2]
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))
        engine.step()
    return engine.module.blocks[0].mlp.load_stats()


def test_expert_load_reaches_the_monitor(tmp_path):
    spec = moe_spec(4, 1, 1.0)
    stats = run_on_ranks(2, steps_with_csv, spec, str(tmp_path))
    assert stats[0] == stats[1]  # the whole token set's load, the same on every rank
    (csv,) = tmp_path.rglob("metrics.csv")
    header = csv.read_text().splitlines()[0].split(",")
    assert sum(1 for c in header if c.startswith("Train/MoE/") and c.endswith("_load")) == 2 * 4  # layers x experts
    assert "Train/MoE/blocks.0.mlp/dropped_share" in header
    assert len(csv.read_text().splitlines()) == 3  # a row per step
