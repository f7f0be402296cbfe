"""Frozen parameters (requires_grad=False) under every strategy: the same losses, norms and
weights as one process with the same layers frozen, the frozen weights untouched, and no
gradient, no optimizer state and no bytes on the wire for them.

Half the layers are frozen (GPT block 0 of 2; blocks 0-1 of 4 in the pipeline model). SGD with
momentum and clipping active on every step: a frozen parameter counted in the norm, or
averaged into a gradient buffer, changes every update.
"""

from __future__ import annotations

import pytest
import torch

import trident
from trident.models.gpt import GPTConfig
from trident.models.gpt_pipe import gpt_names, gpt_pipe, gpt_shard_specs, gpt_state_dict, load_gpt_state_dict
from trident.tensor_parallel import merge_state_dicts, shard_specs
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.parity import (assert_losses_close, assert_norms_close, assert_state_close, optimizer_section,
                                    train_serial)
from tests.parity import test_dp_equivalence as dp
from tests.parity import test_pp_equivalence as pp

LR, CLIP = 0.5, 0.05


def frozen_names(model: torch.nn.Module, layers: tuple[int, ...]) -> set[str]:
    return {n for n, _ in model.named_parameters() if any(n.startswith(f"blocks.{i}.") for i in layers)}


def freeze(model: torch.nn.Module, names: set[str]) -> torch.nn.Module:
    for n, p in model.named_parameters():
        p.requires_grad_(n not in names)
    return model


def serial(make, tokens: torch.Tensor, global_batch: int, layers: tuple[int, ...]):
    model = make()
    freeze(model, frozen_names(model, layers))
    batches = [(b[:, :-1], b[:, 1:]) for b in tokens.split(global_batch)]
    return train_serial(model, batches, "sgd", LR, CLIP)


def counts(make, layers: tuple[int, ...]) -> tuple[int, int]:
    """(trainable, frozen) elements of the serial model."""
    model = make()
    names = frozen_names(model, layers)
    frozen = sum(p.numel() for n, p in model.named_parameters() if n in names)
    return sum(p.numel() for p in model.parameters()) - frozen, frozen


def train_plain(zero: dict, tp: int):
    """Every rank: the plain GPT with block 0 frozen, dp = world / tp, micro 4 per dp rank."""
    mesh = cached_mesh(tp=tp)
    model = dp.make_model()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = frozen_names(model, (0,))
    freeze(model, names)
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 0, "gradient_clipping": CLIP,
           "optimizer": optimizer_section("sgd", LR), "comms_logger": {"enabled": True},
           "zero_optimization": {"reduce_bucket_size": 3000, "sub_group_size": 2000, **zero},
           "tensor_parallel": {"size": tp}}
    engine, *_ = trident.initialize(model=model, config=cfg, mesh=mesh)
    engine.comms_logger.reset()
    losses, norms = dp.train_steps(engine, mesh, 4, 1)
    traffic = {op: s.bytes / dp.STEPS for op, s in engine.comms_logger.totals().items()}
    weights = {k: v.float() for k, v in engine.consolidated_state_dict().items()}
    untouched = all(torch.equal(p.detach(), initial[n]) for n, p in engine.module.named_parameters()
                    if n in names and p.numel() == initial[n].numel())
    local_trainable = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    result = dict(losses=losses, norms=norms, weights=weights, specs=shard_specs(engine.module),
                  memory=engine.memory_breakdown(), traffic=traffic, untouched=untouched,
                  local_trainable=local_trainable, dp=mesh.dp_rank, tp=mesh.tp_rank)
    engine.destroy()
    return result


PLAIN = {
    "dp2-stage0": ({"stage": 0}, 1, 2),
    "dp2-zero1": ({"stage": 1}, 1, 2),
    "dp2-zero2": ({"stage": 2}, 1, 2),
    "dp2-zero3": ({"stage": 3, "stage3_param_persistence_threshold": 0}, 1, 2),
    "dp2-zero3-offload": ({"stage": 3, "stage3_param_persistence_threshold": 0,
                           "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}, 1, 2),
    "tp2": ({"stage": 0}, 2, 2),
    "dp2-tp2-zero1": ({"stage": 1}, 2, 4),
}


@pytest.mark.parametrize("name", list(PLAIN))
def test_frozen_layers_train_like_one_process_and_cost_no_gradient_state_or_traffic(name):
    zero, tp, world = PLAIN[name]
    n_dp = world // tp
    ref = serial(dp.make_model, dp.make_tokens(4 * n_dp), 4 * n_dp, (0,))
    assert max(ref.clip_coefs) < 1.0
    results = run_on_ranks(world, train_plain, zero, tp)
    for r in results:
        assert_norms_close(r["norms"], ref.norms, rtol=1e-6)
        assert r["untouched"]
    assert_losses_close(dp.mean_losses([(r["losses"],) for r in results if r["tp"] == 0]), ref.losses, rtol=1e-5)
    for d in range(n_dp):
        mine = sorted((r for r in results if r["dp"] == d), key=lambda r: r["tp"])
        weights = merge_state_dicts([r["weights"] for r in mine], mine[0]["specs"]) if tp > 1 else mine[0]["weights"]
        assert_state_close(weights, ref.weights, rtol=1e-5)

    trainable, frozen = counts(dp.make_model, (0,))
    stage = zero["stage"]
    for r in results:
        mem = r["memory"]
        local = trainable if tp == 1 else r["local_trainable"]  # (stage 3 parameters are placeholders)
        shard = 1 if stage == 0 else n_dp
        # gradients and optimizer state (SGD momentum; fp32 params are their own masters) of the
        # trainable elements only, split over dp from stage 2 (gradients) and 1 (state); ZeRO
        # pads each unit to a multiple of dp, hence the 5%.
        assert mem["gradients"] == pytest.approx(4 * local / (n_dp if stage >= 2 else 1), rel=0.05)
        if "offload_optimizer" in zero:
            continue  # states and parameter shards are in host memory (test_offload checks placement)
        assert mem["optimizer_states"] == pytest.approx(4 * local / shard, rel=0.05)
        if tp == 1:  # frozen parameters count as parameters (ZeRO-3 partitions them too)
            expected = 4 * (frozen + trainable) / (n_dp if stage == 3 else 1)
            assert mem["parameters"] == pytest.approx(expected, rel=0.05)
            gradient_bytes = r["traffic"].get("all_reduce", 0) + r["traffic"].get("reduce_scatter", 0)
            assert gradient_bytes == pytest.approx(4 * trainable, rel=0.05)  # nothing of the frozen block


def train_pipe(pp_size: int, tp: int, zero_stage: int):
    """Every rank: the pipelined GPT with blocks 0-1 (of 4) frozen."""
    mesh = cached_mesh(pp=pp_size, tp=tp)
    cfg = GPTConfig(**pp.MODEL)
    pipe = gpt_pipe(cfg, pp_size, partition_method="uniform", stage_id=mesh.pp_rank, mesh=mesh if tp > 1 else None)
    load_gpt_state_dict(pipe, pp.make_gpt().state_dict(), cfg)
    to_pipe = gpt_names(cfg)
    names = {to_pipe[g] for g in frozen_names(pp.make_gpt(), (0, 1))}
    for n, p in pipe.named_parameters():
        p.requires_grad_(n not in names)
    gas = 8 // (pp.MICRO * mesh.dp_size)
    engine, *_ = trident.initialize(model=pipe, config=pp.sgd_pipe_config(pp_size, tp, zero_stage, gas, LR, CLIP),
                                    mesh=mesh)
    losses, norms = pp.pipe_steps(engine, mesh, pp.make_tokens(8), pp.STEPS, pp.MICRO, 8)
    weights = {k: v.detach().float().clone() for k, v in gpt_state_dict(pipe, cfg).items()}
    trainable = sum(p.numel() for p in pipe.parameters() if p.requires_grad)
    return (losses, weights, gpt_shard_specs(pipe, cfg), (mesh.pp_rank, mesh.dp_rank, mesh.tp_rank), norms,
            engine.memory_breakdown()["gradients"], trainable)


@pytest.mark.parametrize("pp_size,tp,zero_stage,world", [(2, 1, 0, 2), (2, 2, 1, 4)], ids=["pp2", "pp2-tp2-zero1"])
def test_frozen_layers_under_pipeline_and_3d_train_like_one_process(pp_size, tp, zero_stage, world):
    ref = serial(pp.make_gpt, pp.make_tokens(8)[:pp.STEPS * 8], 8, (0, 1))
    assert max(ref.clip_coefs) < 1.0
    results = run_on_ranks(world, train_pipe, pp_size, tp, zero_stage)
    by_position: dict[tuple, list] = {}
    for losses, weights, specs, (p, d, t), norms, grad_bytes, trainable in results:
        assert_losses_close(losses, ref.losses, rtol=1e-5)
        assert_norms_close(norms, ref.norms, rtol=1e-6)
        assert grad_bytes == 4 * trainable  # stage 0 / ZeRO-1 keep whole fp32 gradients of trainable ones only
        by_position.setdefault((p, d), []).append((t, weights, specs))
    for ranks in by_position.values():
        ranks.sort(key=lambda r: r[0])
        weights = merge_state_dicts([w for _, w, _ in ranks], ranks[0][2]) if len(ranks) > 1 else ranks[0][1]
        assert_state_close(weights, {k: ref.weights[k] for k in weights}, rtol=1e-5)


def train_ps():
    """Ranks 0: a server; 1, 2: sync workers with block 0 frozen (micro 4 each)."""
    import torch.distributed as dist
    from trident.parameter_server import serve

    mesh = cached_mesh()
    model = dp.make_model()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = frozen_names(model, (0,))
    freeze(model, names)
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 0, "gradient_clipping": CLIP,
           "optimizer": optimizer_section("sgd", LR), "zero_optimization": {"stage": 0, "reduce_bucket_size": 3000},
           "parameter_server": {"servers": 1, "mode": "sync"}}
    if dist.get_rank() == 0:
        result = serve(cfg, model, mesh=mesh)
        return {"role": "server", "names": sorted(result.parameters)}
    engine, *_ = trident.initialize(model=model, config=cfg, mesh=mesh)
    losses, norms = [], []
    data = dp.make_tokens(8)
    for step in range(dp.STEPS):
        batch = data[step * 8 + engine.dp_rank * 4:step * 8 + engine.dp_rank * 4 + 4]
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))
        engine.step()
        losses.append(engine.last_loss)
        norms.append(engine.get_global_grad_norm())
    weights = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    untouched = all(torch.equal(p.detach(), initial[n]) for n, p in engine.module.named_parameters() if n in names)
    pushed = engine.comm_bytes()["sent"]
    engine.close()
    return {"role": "worker", "losses": losses, "norms": norms, "weights": weights, "untouched": untouched,
            "memory": engine.memory_breakdown(), "sent": pushed}


def test_frozen_layers_under_the_parameter_server_are_neither_pushed_nor_served():
    ref = serial(dp.make_model, dp.make_tokens(8), 8, (0,))
    results = run_on_ranks(3, train_ps)
    server = next(r for r in results if r["role"] == "server")
    workers = [r for r in results if r["role"] == "worker"]
    assert not any(n.startswith("blocks.0.") for n in server["names"])  # the servers hold no frozen weight
    assert_losses_close(dp.mean_losses([(r["losses"],) for r in workers]), ref.losses, rtol=1e-5)
    trainable, _ = counts(dp.make_model, (0,))
    for r in workers:
        assert r["untouched"]
        assert_norms_close(r["norms"], ref.norms, rtol=1e-6)
        assert_state_close(r["weights"], ref.weights, rtol=1e-5)
        assert r["memory"]["gradients"] == 4 * trainable
        assert r["sent"] < 4 * trainable * (dp.STEPS + 1) + 64 * 1024  # fp32 gradients of trainable ones only


def save_and_reload(root: str, stage_before: int, stage_after: int):
    """Every rank: ZeRO `stage_before` with block 0 frozen trains 3 steps and saves; a fresh
    engine at `stage_after` loads it (the same layout, or resharded). Returns both consolidated
    states and whether the fresh engine partitions a frozen weight."""
    mesh = cached_mesh()

    def build(stage: int):
        model = freeze(dp.make_model(), frozen_names(dp.make_model(), (0,)))
        cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 0, "gradient_clipping": CLIP,
               "optimizer": optimizer_section("sgd", LR),
               "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
        return trident.initialize(model=model, config=cfg, mesh=mesh)[0]

    engine = build(stage_before)
    data = dp.make_tokens(8)
    for step in range(3):
        batch = data[step * 8 + mesh.dp_rank * 4:step * 8 + mesh.dp_rank * 4 + 4]
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))
        engine.step()
    engine.save_checkpoint(root)
    saved = {k: v.float() for k, v in engine.consolidated_state_dict().items()}
    fresh = build(stage_after)
    with torch.no_grad():  # so that only the checkpoint can bring the frozen weights back
        for p in fresh.module.parameters():
            if not p.requires_grad:
                p.zero_()
    fresh.load_checkpoint(root)
    frozen_sharded = fresh.module.blocks[0].mlp.fc.weight.numel() == 0  # a placeholder: its data is in shards
    return saved, {k: v.float() for k, v in fresh.consolidated_state_dict().items()}, frozen_sharded


@pytest.mark.parametrize("stage_before,stage_after", [(3, 3), (3, 0), (0, 3)],
                         ids=["zero3-same-layout", "zero3-to-stage0", "stage0-to-zero3"])
def test_checkpoints_keep_frozen_parameters_partitioned_or_not(stage_before, stage_after, tmp_path):
    for saved, loaded, frozen_sharded in run_on_ranks(2, save_and_reload, str(tmp_path), stage_before, stage_after):
        assert frozen_sharded == (stage_after == 3)  # ZeRO-3 partitions frozen weights too
        assert_state_close(loaded, saved, rtol=0)
        assert not torch.equal(saved["blocks.1.mlp.fc.weight"], dp.make_model().state_dict()["blocks.1.mlp.fc.weight"])
