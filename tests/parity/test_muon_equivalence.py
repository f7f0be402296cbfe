"""Muon under trident trains to the same losses and weights as one plain-PyTorch process running
trident.optim.Muon (fp32, rtol 1e-5), with gradient clipping active on every step: data
parallelism (ZeRO stage 0) holds whole matrices, so Newton-Schulz sees what one process sees;
under ZeRO 1-3 (trident.zero.muon) each matrix is gathered to an owner rank and its shards
scattered back; under ZeRO-Offload the momentum stays on the host. States on NVMe are refused."""

from __future__ import annotations

import functools

import pytest
import torch

import trident
from trident.engine.full_state import full_state_dict
from trident.models.gpt import GPT, GPTConfig
from trident.planner import Layout, Workload, make_cluster
from trident.planner.comm import muon_traffic
from trident.planner.presets import model_from_gpt_config
from trident.tensor_parallel import parallelize
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.parity import (SerialRun, assert_losses_close, assert_norms_close, assert_state_close,
                                    optimizer_section, train_serial)

STEPS = 6
MODEL = dict(vocab_size=61, seq_len=16, n_layer=2, n_head=2, d_model=32, dropout=0.0, bias=False)
LR = 3e-3
CLIP = 0.05  # below the gradient norm on every step
HIDDEN = [f"blocks.{i}.{m}.weight" for i in range(2) for m in ("attn.proj", "attn.qkv", "mlp.fc", "mlp.proj")]
"""The matrices Muon steps: not the embeddings (tied to the head) nor the norms."""
TP_PLAN = {"attn.qkv": "column", "attn.proj": "row", "mlp.fc": "column", "mlp.proj": "row"}


def make_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**MODEL))


def make_tokens(global_batch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, MODEL["vocab_size"], (STEPS * global_batch, MODEL["seq_len"] + 1), generator=g)


def config(micro: int, stage: int = 0, offload: str = "none") -> dict:
    # small buckets: several units per partition group, matrices split across ranks
    # and sub-groups of 1000 elements: a matrix's shard spans several master chunks
    zero = {"stage": stage, "reduce_bucket_size": 3000, "sub_group_size": 1000,
            "offload_optimizer": {"device": offload}}
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
            "optimizer": optimizer_section("muon", LR), "gradient_clipping": CLIP,
            "communication_data_type": "fp32", "zero_optimization": zero, "steps_per_print": 0}


@functools.lru_cache(maxsize=None)
def serial_reference(global_batch: int) -> SerialRun:
    data = make_tokens(global_batch)
    return train_serial(make_model(), [(b[:, :-1], b[:, 1:]) for b in data.split(global_batch)], "muon", LR, CLIP)


def run_steps(engine, mesh, micro: int, first: int = 0, last: int = STEPS) -> tuple[list[float], list[float]]:
    """Steps first..last-1, each on this dp rank's `micro` rows of a global batch of micro x dp;
    the losses and global gradient norms."""
    global_batch = micro * mesh.dp_size
    data = make_tokens(global_batch)
    losses, norms = [], []
    for step in range(first, last):
        batch = data[step * global_batch + mesh.dp_rank * micro:][:micro]
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))
        engine.step()
        losses.append(engine.last_loss)
        norms.append(engine.get_global_grad_norm())
    return losses, norms


def train_dp(micro: int, stage: int = 0, tp: int = 1):
    mesh = cached_mesh(tp=tp)
    model = make_model()
    if tp > 1:
        parallelize(model, TP_PLAN, mesh)  # slices the full weights: qkv, fc by rows, proj by columns
    engine, _, _, _ = trident.initialize(model=model, config={**config(micro, stage), "tensor_parallel": {"size": tp}},
                                         mesh=mesh)
    assert mesh.tp_size == tp
    losses, norms = run_steps(engine, mesh, micro)
    muon = sorted(n for n, p in engine.module.named_parameters() if p.use_muon)
    weights = {k: v.float() for k, v in full_state_dict(engine).items()}
    return losses, weights, norms, muon


@pytest.mark.parametrize("world,stage", [(1, 0), (2, 0), (2, 1), (2, 2), (2, 3)])
def test_muon_matches_serial_with_active_clipping(world, stage):
    ref = serial_reference(4 * world)
    assert max(ref.clip_coefs) < 1.0, f"clipping inactive on some step: {ref.clip_coefs}"
    results = run_on_ranks(world, train_dp, 4, stage)
    check(results, ref, world)


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_muon_tp2_gathers_each_slice_whole(stage):
    """Each matrix split over 2 tensor-parallel ranks (qkv with its fused q/k/v blocks): gathered
    over tp, orthogonalized whole, each rank keeping its slice; under ZeRO by the matrix's owner."""
    ref = serial_reference(4)
    check(run_on_ranks(2, train_dp, 4, stage, 2), ref, 1)


@pytest.mark.parametrize("stage", [0, 3])
def test_muon_dp2_tp2_matches_one_process(stage):
    """4 ranks, dp 2 x tp 2: under ZeRO-3 a matrix's owner is a dp rank, and the two owners of its
    tp slices (the same dp rank on each tp rank) gather them whole over tp; under stage 0 every dp
    replica orthogonalizes its slices' wholes itself."""
    check(run_on_ranks(4, train_dp, 4, stage, 2), serial_reference(8), 2)


def check(results, ref: SerialRun, dp: int) -> None:
    """Losses, every rank's gradient norms and whole weights against one process."""
    per_step = [sum(step) / len(step) for step in zip(*[r[0] for r in results])]
    assert_losses_close(per_step, ref.losses, rtol=1e-5)
    for _, weights, norms, muon in results:
        assert_norms_close(norms, ref.norms, rtol=1e-6)
        assert_state_close(weights, ref.weights, rtol=1e-5)
        # the hidden matrices, not the embeddings (tied to the head) nor the norms
        assert muon == HIDDEN


def muon_matrices_under_zero_init():
    """Built partitioned by zero.Init: the matrix test reads each layer's shape, not its
    flat placeholder, so Muon still gets the hidden matrices."""
    mesh = cached_mesh()
    with trident.zero.Init(mesh=mesh):
        model = make_model()
    engine, _, _, _ = trident.initialize(model=model, config=config(4, 3), mesh=mesh)
    muon = engine.strategy.muon
    return sorted(n for n, p in engine.module.named_parameters() if p.use_muon), muon.owners, muon.bytes_per_step


def test_zero_init_parameters_keep_their_muon_matrices():
    """...and the owners of the 8 matrices' units are spread evenly over the 2 dp ranks; the bytes
    gathered to them and scattered back are the planner's figure (its blocks count the norm gains
    too: 0.5% here)."""
    for names, owners, moved in run_on_ranks(2, muon_matrices_under_zero_init):
        assert names == HIDDEN and len(owners) == len(HIDDEN) and sorted(owners.values()) == [0] * 4 + [1] * 4
        assert moved == 4 * sum(p.numel() for n, p in make_model().named_parameters() if n in HIDDEN)
    spec = model_from_gpt_config(GPTConfig(**MODEL), "parity")
    traffic = muon_traffic(spec, Layout(dp=2, zero_stage=3), Workload(16, 8, optimizer="muon"),
                           make_cluster("a100-80gb", 2, 8))
    assert [t.op for t in traffic] == ["gather", "scatter"]
    assert [t.calls for t in traffic] == [len(HIDDEN)] * 2  # one gather and one scatter per matrix's module
    wire = sum(t.bytes_per_step * (2 - 1) / 2 for t in traffic)  # into or out of an owner: (n - 1) / n of S
    assert wire == pytest.approx(moved, rel=0.01)


def train_offloaded(stage: int):
    """ZeRO-Offload: momentum, masters and the step on the host, gathers and Newton-Schulz on the
    parameters' device (here both the CPU: the paths still differ, host buffers vs partitions)."""
    mesh = cached_mesh()
    engine, _, _, _ = trident.initialize(model=make_model(), config=config(4, stage, offload="cpu"), mesh=mesh)
    assert engine.strategy.placement.device == "cpu" and engine.strategy.muon is not None
    losses, _ = run_steps(engine, mesh, 4)
    return losses, {k: v.float() for k, v in full_state_dict(engine).items()}


@pytest.mark.parametrize("stage", [2, 3])
def test_muon_with_optimizer_states_offloaded_to_the_host_matches_one_process(stage):
    ref = serial_reference(8)
    results = run_on_ranks(2, train_offloaded, stage)
    assert_losses_close([sum(s) / 2 for s in zip(*[r[0] for r in results])], ref.losses, rtol=1e-5)
    for _, weights in results:
        assert_state_close(weights, ref.weights, rtol=1e-5)


def start_nvme(path: str):
    cfg = config(4, stage=2)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": path}
    trident.initialize(model=make_model(), config=cfg, mesh=cached_mesh())


def test_muon_with_states_on_nvme_is_refused_with_the_key_named(tmp_path):
    with pytest.raises(Exception, match="zero_optimization.offload_optimizer.device: nvme: Muon keeps its "
                                        "momentum in host memory"):
        run_on_ranks(1, start_nvme, str(tmp_path))


def train_resumed(root: str, stage: int, stage_after: int):
    """STEPS // 2 steps, a checkpoint, a fresh engine (maybe another ZeRO stage) loads it and
    trains the rest: Muon's momentum must come back exactly."""
    mesh = cached_mesh()
    engine = None
    for first, last, st in ((0, STEPS // 2, stage), (STEPS // 2, STEPS, stage_after)):
        if engine is not None:
            engine.save_checkpoint(root)
        engine, _, _, _ = trident.initialize(model=make_model(), config=config(4, st), mesh=mesh)
        if first:
            engine.load_checkpoint(root)
        run_steps(engine, mesh, 4, first, last)
    return {k: v.float() for k, v in full_state_dict(engine).items()}


@pytest.mark.parametrize("stage,stage_after", [(2, 2), (1, 3)])
def test_muon_state_resumes_from_a_checkpoint(stage, stage_after, tmp_path):
    ref = serial_reference(8)
    for weights in run_on_ranks(2, train_resumed, str(tmp_path), stage, stage_after):
        assert_state_close(weights, ref.weights, rtol=1e-5)


def train_bf16(stage: int):
    mesh = cached_mesh()
    engine, _, _, _ = trident.initialize(model=make_model(), config={**config(4, stage), "bf16": {"enabled": True}},
                                         mesh=mesh)
    losses, _ = run_steps(engine, mesh, 4)
    muon = [p for g in engine.optimizer.param_groups if g["use_muon"] for p in g["params"]]
    return losses, len(muon), {p.dtype for p in muon}


@pytest.mark.parametrize("world,stage", [(1, 0), (2, 2)])
def test_muon_in_bf16_steps_the_fp32_masters(world, stage):
    """bf16 weights, fp32 masters: the masters of the hidden matrices carry the Muon tag (stage 0)
    or sit in Muon's partition groups (ZeRO), and training follows fp32's losses."""
    ref = serial_reference(4 * world)
    for losses, count, dtypes in run_on_ranks(world, train_bf16, stage):
        assert dtypes == {torch.float32} and (count == len(HIDDEN) if stage == 0 else count > 0)
        assert_losses_close(losses, ref.losses, rtol=2e-2)


def train_tp_bf16(user_built: bool):
    """tp=2, bf16 weights with fp32 masters, stage 0; Muon from the config, or built by the user
    from param groups that say `use_muon` themselves (Moonlight's way: no tags on the tensors)."""
    from trident.optim import Muon
    from trident.testing.parity import ADAMW_WEIGHT_DECAY
    mesh = cached_mesh(tp=2)
    model = make_model()
    parallelize(model, TP_PLAN, mesh)
    cfg = {**config(4), "tensor_parallel": {"size": 2}, "bf16": {"enabled": True}}
    optimizer = None
    if user_built:
        cfg.pop("optimizer")
        named = dict(model.named_parameters())
        optimizer = Muon([{"params": [named[n] for n in HIDDEN], "use_muon": True},
                          {"params": [p for n, p in named.items() if n not in HIDDEN], "use_muon": False}],
                         lr=LR, weight_decay=ADAMW_WEIGHT_DECAY)
    engine, _, _, _ = trident.initialize(model=model, optimizer=optimizer, config=cfg, mesh=mesh)
    run_steps(engine, mesh, 4)
    return {k: v.float() for k, v in full_state_dict(engine).items()}


def test_user_built_muon_gathers_tp_slices_of_bf16_masters():
    """The fp32 masters of tp slices carry the split for a Muon the user built too (untagged
    tensors): the same weights as the config-built Muon, not slices orthogonalized alone."""
    config_built = run_on_ranks(2, train_tp_bf16, False)
    for got, want in zip(run_on_ranks(2, train_tp_bf16, True), config_built):
        assert_state_close(got, want, rtol=1e-6)


def train_part(root: str, stage: int, micro: int, first: int, last: int):
    """Steps first..last-1 of a global batch of 8 rows; loads `root` first unless first is 0,
    saves it afterwards unless last is STEPS."""
    mesh = cached_mesh()
    engine, _, _, _ = trident.initialize(model=make_model(), config=config(micro, stage), mesh=mesh)
    if first:
        engine.load_checkpoint(root)
    run_steps(engine, mesh, micro, first, last)  # micro x dp = 8 rows a step on 2 ranks and on 1
    if last < STEPS:
        engine.save_checkpoint(root)
    return {k: v.float() for k, v in full_state_dict(engine).items()}


def test_muon_state_reshards_from_two_ranks_to_one(tmp_path):
    """ZeRO-2 over 2 ranks saves Muon's sharded momentum; one rank under stage 0 resumes from it."""
    run_on_ranks(2, train_part, str(tmp_path), 2, 4, 0, STEPS // 2)
    (weights,) = run_on_ranks(1, train_part, str(tmp_path), 0, 8, STEPS // 2, STEPS)
    assert_state_close(weights, serial_reference(8).weights, rtol=1e-5)


DEEPSPEED_MUON_CONFIG = {"train_batch_size": 4, "optimizer": {"type": "muon", "params": {"lr": 0.02}},
                         "bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
                         "zero_allow_untested_optimizer": True}
"""The config of DeepSpeed's own Muon tests (tests/unit/ops/muon/test_muon.py, its bf16 checkpoint
case), as they write it: lower-case type, one lr for both groups."""


def deepspeed_script_groups():
    """`import trident as deepspeed`, the way a DeepSpeed script starts Muon: `deepspeed.initialize`
    with `model_parameters` and DeepSpeed's config."""
    import trident as deepspeed
    model = make_model()
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=DEEPSPEED_MUON_CONFIG, mesh=cached_mesh())
    return [(g["use_muon"], g["lr"], g.get("adjust_lr"), len(g["params"])) for g in engine.optimizer.param_groups]


def test_deepspeeds_own_muon_config_builds_what_deepspeed_builds():
    """DeepSpeed's engine gives `lr` to both MuonWithAuxAdam groups and scales updates by
    sqrt(max(1, n / m)): the Muon group here holds the hidden matrices, AdamW the rest, both at 0.02."""
    groups = run_on_ranks(1, deepspeed_script_groups)[0]
    muon = [g for g in groups if g[0]]
    adam = [g for g in groups if not g[0]]
    assert muon and adam and {g[1] for g in groups} == {0.02} and {g[2] for g in muon} == {"spectral"}
