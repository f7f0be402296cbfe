"""Checkpoints load under any layout: save at step 5 under layout A, load under layout B, and
steps 6-10 match an uninterrupted run under B from the same initial weights (fp32, rtol 1e-5).

A layout is (pp, dp, tp, ZeRO stage). Two model families: the reference GPT as a
PipelineModule (pipeline stages, tied embeddings across stages, tensor-parallel layers with the
vocabulary padded to a multiple of tp, the tied copy on the last stage a tp-split buffer) and
the plain GPT with trident's native tensor parallelism. The
global batch is the same under every layout (8 sequences: micro 2 x accumulation x dp).
"""

from __future__ import annotations

import functools

import pytest
import torch

import trident
from trident.checkpointing.consolidate import get_fp32_state_dict_from_zero_checkpoint
from trident.checkpointing.reshard import reshard
from trident.models.gpt import GPT, GPTConfig
from trident.models.gpt_pipe import gpt_pipe, gpt_shard_specs, gpt_state_dict, load_gpt_state_dict
from trident.tensor_parallel import merge_state_dicts, shard_specs
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.parity import assert_losses_close, assert_state_close
from tests.parity.test_pp_equivalence import MODEL, make_gpt, make_tokens
from tests.parity.test_dp_equivalence import train_range

MICRO, GLOBAL, SAVE_AT, STEPS = 2, 8, 5, 10


def _config(pp: int, dp: int, tp: int, zero: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GLOBAL // (MICRO * dp),
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
            "gradient_clipping": 0.05, "steps_per_print": 0,
            "zero_optimization": {"stage": zero, "reduce_bucket_size": 2000, "sub_group_size": 1500},
            "pipeline": {"stages": pp, "schedule": "1f1b", "partition_method": "uniform"},
            "tensor_parallel": {"size": tp}}


def _pipe_engine(layout):
    pp, dp, tp, zero = layout
    mesh = cached_mesh(pp=pp, tp=tp)
    cfg = GPTConfig(**MODEL)
    pipe = gpt_pipe(cfg, pp, partition_method="uniform", stage_id=mesh.pp_rank, mesh=mesh)
    load_gpt_state_dict(pipe, make_gpt().state_dict(), cfg)
    engine, *_ = trident.initialize(model=pipe, config=_config(pp, dp, tp, zero), mesh=mesh)
    return engine, mesh


def _pipe_steps(engine, mesh, start: int, stop: int) -> list[float]:
    data = make_tokens(GLOBAL)
    gas = GLOBAL // (MICRO * mesh.dp_size)
    losses = []
    for step in range(start, stop):
        first = step * GLOBAL + mesh.dp_rank * MICRO * gas
        mine = data[first:first + MICRO * gas]
        micro = [(mine[k:k + MICRO, :-1], mine[k:k + MICRO, 1:]) for k in range(0, len(mine), MICRO)]
        losses.append(float(engine.train_batch(iter(micro))))
    return losses


def _pipe_result(engine, mesh, losses):
    cfg = GPTConfig(**MODEL)
    weights = {k: v.detach().float().clone() for k, v in gpt_state_dict(engine.module, cfg).items()}
    return losses, weights, gpt_shard_specs(engine.module, cfg), (mesh.pp_rank, mesh.dp_rank, mesh.tp_rank)


def pipe_run(layout, root: str | None, mode: str):
    """mode: 'save' (steps 1-5, save), 'resume' (load, steps 6-10), 'straight' (steps 1-10)."""
    engine, mesh = _pipe_engine(layout)
    if mode == "save":
        losses = _pipe_steps(engine, mesh, 0, SAVE_AT)
        engine.save_checkpoint(root)
        return _pipe_result(engine, mesh, losses)
    if mode == "resume":
        engine.load_checkpoint(root)
        assert engine.global_steps == SAVE_AT
        return _pipe_result(engine, mesh, _pipe_steps(engine, mesh, SAVE_AT, STEPS))
    return _pipe_result(engine, mesh, _pipe_steps(engine, mesh, 0, STEPS)[SAVE_AT:])


def _world(layout) -> int:
    pp, dp, tp, _ = layout
    return pp * dp * tp


def merged(results):
    """Every rank's losses and the whole model's weights, tp shards merged, stages joined."""
    shards: dict[tuple, list] = {}
    for _, weights, specs, (pp, dp, tp) in results:
        if dp == 0:
            shards.setdefault(pp, []).append((tp, weights, specs))
    whole = {}
    for ranks in shards.values():
        ranks.sort(key=lambda r: r[0])
        whole.update(merge_state_dicts([w for _, w, _ in ranks], ranks[0][2]) if len(ranks) > 1 else ranks[0][1])
    return [r[0] for r in results], whole


@functools.lru_cache(maxsize=None)
def straight(layout):
    return merged(run_on_ranks(_world(layout), pipe_run, layout, None, "straight"))


def check_resumed(resumed, layout_b) -> None:
    ref_losses, ref_weights = straight(layout_b)
    losses, weights = merged(resumed)
    for mine in losses:
        assert_losses_close(mine, ref_losses[0], rtol=1e-5)
    assert_state_close(weights, ref_weights, rtol=1e-5)


PAIRS = [
    ((2, 1, 2, 0), (1, 2, 2, 1)),   # pp and tp to dp, stage 0 -> ZeRO-1
    ((2, 2, 1, 1), (1, 4, 1, 2)),   # ZeRO-1 partitions over 2 -> ZeRO-2 over 4, pipeline joined
    ((1, 2, 2, 3), (2, 1, 2, 0)),   # ZeRO-3 partitions -> pipeline stages, tied copy rebuilt
    ((1, 4, 1, 2), (1, 1, 1, 0)),   # everything back to one process
    ((2, 2, 1, 1), (2, 1, 2, 1)),   # dp -> tp at the same pipeline split
]


@pytest.mark.parametrize("layout_a,layout_b", PAIRS, ids=lambda l: "pp{}dp{}tp{}z{}".format(*l))
def test_checkpoint_loads_under_another_layout(layout_a, layout_b, tmp_path):
    root = str(tmp_path / "ckpt")
    run_on_ranks(_world(layout_a), pipe_run, layout_a, root, "save")
    check_resumed(run_on_ranks(_world(layout_b), pipe_run, layout_b, root, "resume"), layout_b)


def test_offline_reshard_then_load(tmp_path):
    """`reshard` writes the (pp, dp, tp) files; a ZeRO run cuts its partitions when it loads them."""
    root = tmp_path / "ckpt"
    run_on_ranks(4, pipe_run, (1, 2, 2, 1), str(root), "save")
    out = reshard(root / f"global_step{SAVE_AT}", tmp_path / "re" / "global_step5", pp=2, tp=1, dp=2)
    (tmp_path / "re" / "latest").write_text(out.name)
    files = sorted(p.name for p in out.iterdir())
    assert "model_pp1_tp0.safetensors" in files and "optim_pp1_tp0.pt" in files
    before = get_fp32_state_dict_from_zero_checkpoint(root)
    after = get_fp32_state_dict_from_zero_checkpoint(out)
    assert_state_close(after, before, rtol=0)
    layout_b = (2, 2, 1, 1)
    check_resumed(run_on_ranks(4, pipe_run, layout_b, str(tmp_path / "re"), "resume"), layout_b)


# -- the plain GPT with native tensor parallelism (vocabulary padded over tp) -------------------

GPT_MODEL = dict(MODEL, n_layer=2)


def gpt_run(dp: int, tp: int, zero: int, root: str | None, mode: str):
    mesh = cached_mesh(tp=tp)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**GPT_MODEL), mesh if tp > 1 else None)
    config = _config(1, dp, tp, zero)
    del config["pipeline"]
    engine, *_ = trident.initialize(model=model, config=config, mesh=mesh)
    if mode == "resume":
        engine.load_checkpoint(root)
    first, last = {"save": (0, SAVE_AT), "resume": (SAVE_AT, STEPS), "straight": (0, STEPS)}[mode]
    losses, _ = train_range(engine, mesh, make_tokens(GLOBAL), first, last, MICRO, GLOBAL)
    if mode == "save":
        engine.save_checkpoint(root)
    losses = losses[SAVE_AT:] if mode == "straight" else losses
    weights = {k: v.float() for k, v in engine.consolidated_state_dict().items()}
    return losses, weights, shard_specs(engine.module), (0, mesh.dp_rank, mesh.tp_rank)


def _gpt_mean(results) -> list[float]:
    """The global batch's loss: the mean of the dp ranks' losses (tp ranks agree)."""
    firsts = [r[0] for r in results if r[3][2] == 0]
    return [sum(step) / len(step) for step in zip(*firsts)]


@pytest.mark.parametrize("a,b", [((2, 2, 3), (4, 1, 1)), ((4, 1, 2), (2, 2, 0))],
                         ids=["dp2tp2z3-dp4z1", "dp4z2-dp2tp2z0"])
def test_plain_gpt_tp_with_padded_vocabulary_reshards(a, b, tmp_path):
    root = str(tmp_path / "ckpt")
    run_on_ranks(a[0] * a[1], gpt_run, *a, root, "save")
    resumed = run_on_ranks(b[0] * b[1], gpt_run, *b, root, "resume")
    ref = run_on_ranks(b[0] * b[1], gpt_run, *b, None, "straight")
    assert_losses_close(_gpt_mean(resumed), _gpt_mean(ref), rtol=1e-5)
    assert_state_close(merged(resumed)[1], merged(ref)[1], rtol=1e-5)
