"""LoRA under every layout trains like one process applying the same LoRA (fp32, clipped SGD).

The serial reference is the parity GPT with `trident.peft.apply_lora` (seeded, so every layout
draws the same adapters) trained in plain PyTorch. Parallel runs get LoRA from the config's
`lora` section through `trident.initialize`. Checked: losses and adapter weights against serial,
gradient norms to 1e-6, the frozen base bit-identical to its start, and that gradients, optimizer
states and gradient traffic cover the adapters only.
"""

from __future__ import annotations

import pytest
import torch

import trident
from trident.peft import apply_lora
from trident.tensor_parallel import merge_state_dicts, shard_specs
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.parity import (assert_losses_close, assert_norms_close, assert_state_close, optimizer_section,
                                    train_serial)
from tests.parity import test_dp_equivalence as dp

LORA = {"r": 4, "alpha": 8.0, "target_modules": ["qkv", "proj", "fc"]}
SEED, LR, CLIP = 1234, 0.5, 0.05


def lora_gpt() -> torch.nn.Module:
    return apply_lora(dp.make_model(), seed=SEED, **LORA)


def serial(global_batch: int):
    tokens = dp.make_tokens(global_batch)
    return train_serial(lora_gpt(), [(b[:, :-1], b[:, 1:]) for b in tokens.split(global_batch)], "sgd", LR, CLIP)


def adapter_numel() -> int:
    return sum(p.numel() for p in lora_gpt().parameters() if p.requires_grad)


def train_lora(zero: dict, tp: int, extra: dict | None = None):
    mesh = cached_mesh(tp=tp)
    sequence_parallel = zero.pop("sequence_parallel", False)
    base = dp.make_model()
    start = {k: v.clone() for k, v in base.state_dict().items()}
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 0, "gradient_clipping": CLIP, "seed": SEED,
           "optimizer": optimizer_section("sgd", LR), "comms_logger": {"enabled": True}, "lora": LORA,
           "zero_optimization": {"reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 0, **zero},
           "tensor_parallel": {"size": tp, "sequence_parallel": sequence_parallel}, **(extra or {})}
    engine, *_ = trident.initialize(model=base, config=cfg, mesh=mesh)
    engine.comms_logger.reset()
    losses, norms = dp.train_steps(engine, mesh, 4, 1)
    traffic = {op: s.bytes / dp.STEPS for op, s in engine.comms_logger.totals().items()}
    weights = {k: v.float() for k, v in engine.consolidated_state_dict().items()}
    local_adapters = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    return dict(losses=losses, norms=norms, weights=weights, specs=shard_specs(engine.module), start=start,
                memory=engine.memory_breakdown(), split=engine.memory_breakdown(split_parameters=True),
                traffic=traffic, local=local_adapters,
                dp=mesh.dp_rank, tp=mesh.tp_rank)


LAYOUTS = {
    "dp2-stage0": ({"stage": 0}, 1, 2),
    "dp2-zero1": ({"stage": 1}, 1, 2),
    "dp2-zero2": ({"stage": 2}, 1, 2),
    "dp2-zero3": ({"stage": 3}, 1, 2),
    "tp2": ({"stage": 0}, 2, 2),
    "dp2-tp2-zero1": ({"stage": 1}, 2, 4),
    "tp2-sp": ({"stage": 0, "sequence_parallel": True}, 2, 2),  # adapters on sequence shards
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lora_trains_like_one_process_with_adapter_only_gradients_state_and_traffic(name):
    zero, tp, world = LAYOUTS[name]
    n_dp = world // tp
    ref = serial(4 * n_dp)
    assert max(ref.clip_coefs) < 1.0
    results = run_on_ranks(world, train_lora, zero, tp)
    assert_losses_close(dp.mean_losses([(r["losses"],) for r in results if r["tp"] == 0]), ref.losses, rtol=1e-5)
    for r in results:
        assert_norms_close(r["norms"], ref.norms, rtol=1e-6)
    for d in range(n_dp):
        mine = sorted((r for r in results if r["dp"] == d), key=lambda r: r["tp"])
        weights = merge_state_dicts([r["weights"] for r in mine], mine[0]["specs"]) if tp > 1 else mine[0]["weights"]
        assert_state_close(weights, ref.weights, rtol=1e-5)
        for k, v in mine[0]["start"].items():  # the frozen base never moves
            assert torch.equal(weights[k.replace(".weight", ".base.weight").replace(".bias", ".base.bias")
                                       if k.endswith(("qkv.weight", "proj.weight", "fc.weight", "qkv.bias",
                                                      "proj.bias", "fc.bias")) else k], v), k
    adapters, stage = adapter_numel(), zero["stage"]
    for r in results:
        local = adapters if tp == 1 else r["local"]
        assert r["memory"]["gradients"] == pytest.approx(4 * local / (n_dp if stage >= 2 else 1), rel=0.05)
        assert r["memory"]["optimizer_states"] == pytest.approx(4 * local / (n_dp if stage >= 1 else 1), rel=0.05)
        split = r["split"]  # the frozen base apart: whole, or its shards under ZeRO-3
        assert split["frozen_parameters"] + split["trainable_parameters"] == r["memory"]["parameters"]
        if tp == 1:
            base = sum(p.numel() for p in dp.make_model().parameters()) * 4
            assert split["frozen_parameters"] == pytest.approx(base / (n_dp if stage == 3 else 1), rel=0.05)
            assert split["trainable_parameters"] == pytest.approx(4 * adapters / (n_dp if stage == 3 else 1), rel=0.05)
        if tp == 1:  # gradient bytes on the wire per step: the adapters' (padded to dp under ZeRO)
            sent = r["traffic"].get("all_reduce", 0) + r["traffic"].get("reduce_scatter", 0)
            assert sent == pytest.approx(4 * adapters, rel=0.05)


def test_lora_with_bf16_and_activation_checkpointing():
    """Recomputing the wrapped blocks changes nothing (bit-identical losses and adapters); a bf16
    base with fp32 master adapters tracks the fp32 run within 16-bit noise (2%)."""
    recompute = {"activation_checkpointing": {"layers": [r"blocks\.\d+"]}}
    plain = run_on_ranks(2, train_lora, {"stage": 2}, 1)
    checkpointed = run_on_ranks(2, train_lora, {"stage": 2}, 1, recompute)
    for a, b in zip(plain, checkpointed):
        assert a["losses"] == b["losses"]
        assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"] if "lora_" in k)
    bf16 = run_on_ranks(2, train_lora, {"stage": 2}, 1, {**recompute, "bf16": {"enabled": True}})
    assert_losses_close(dp.mean_losses([(r["losses"],) for r in bf16]),
                        dp.mean_losses([(r["losses"],) for r in plain]), rtol=2e-2)
    assert bf16[0]["memory"]["gradients"] == pytest.approx(2 * adapter_numel() / 2, rel=0.05)  # bf16, /dp


def test_bad_lora_input_is_named():
    with pytest.raises(ValueError, match=r"lora.target_modules: \['nope'\] match no module"):
        apply_lora(dp.make_model(), target_modules=["qkv", "nope"])
    with pytest.raises(ValueError, match="lora.r must be a positive integer"):
        apply_lora(dp.make_model(), r=0)
    with pytest.raises(ValueError, match="'embed.wte' is a Embedding"):
        apply_lora(dp.make_model(), target_modules=["wte"])


# -- pipelines: the user applies LoRA to the PipelineModule, with the serial adapters ---------------

def _pipe_names(cfg) -> dict[str, str]:
    """GPT module path -> PipelineModule module path, for every adapted layer."""
    from trident.models.gpt_pipe import gpt_names
    return {g[:-len(".weight")]: p[:-len(".weight")] for g, p in gpt_names(cfg).items()
            if g.endswith(("qkv.weight", "proj.weight", "fc.weight"))}


def train_lora_pipe(pp_size: int, tp: int, zero_stage: int):
    """Every rank: the pipelined parity GPT (tp-native layers when tp > 1) with LoRA on its
    stage's layers, adapters copied from the serial LoRA GPT (tp-sliced where split)."""
    from trident.models.gpt import GPTConfig
    from trident.models.gpt_pipe import gpt_pipe, load_gpt_state_dict
    from tests.parity import test_pp_equivalence as pp

    mesh = cached_mesh(pp=pp_size, tp=tp)
    cfg = GPTConfig(**pp.MODEL)
    pipe = gpt_pipe(cfg, pp_size, partition_method="uniform", stage_id=mesh.pp_rank, mesh=mesh if tp > 1 else None)
    load_gpt_state_dict(pipe, pp.make_gpt().state_dict(), cfg)
    serial = apply_lora(pp.make_gpt(), seed=SEED, **LORA).state_dict()
    held = {m for m, _ in pipe.named_modules()}
    names = {g: p for g, p in _pipe_names(cfg).items() if p in held}
    apply_lora(pipe, **{**LORA, "target_modules": [f"^{p.replace('.', '[.]')}$" for p in names.values()]})
    with torch.no_grad():
        own = dict(pipe.named_parameters())
        for g, p in names.items():
            for part in ("lora_A", "lora_B"):
                t, full = own[f"{p}.{part}"], serial[f"{g}.{part}"]
                spec = getattr(t, "tp_spec", None)
                t.copy_(spec.shard(full, mesh.tp_rank) if spec is not None else full)
    gas = 8 // (pp.MICRO * mesh.dp_size)
    engine, *_ = trident.initialize(model=pipe, config=pp.sgd_pipe_config(pp_size, tp, zero_stage, gas, LR, CLIP),
                                    mesh=mesh)
    losses, norms = pp.pipe_steps(engine, mesh, pp.make_tokens(8), pp.STEPS, pp.MICRO, 8)
    adapters = {f"{g}.{part}": (own[f"{p}.{part}"].detach().clone(), getattr(own[f"{p}.{part}"], "tp_spec", None))
                for g, p in names.items() for part in ("lora_A", "lora_B")}
    return losses, norms, adapters, (mesh.pp_rank, mesh.dp_rank, mesh.tp_rank)


@pytest.mark.parametrize("pp_size,tp,zero_stage,world", [(2, 1, 0, 2), (2, 2, 1, 4)], ids=["pp2", "pp2-tp2-zero1"])
def test_lora_under_pipeline_and_3d_trains_like_one_process(pp_size, tp, zero_stage, world):
    check_lora_pipe(run_on_ranks(world, train_lora_pipe, pp_size, tp, zero_stage))


@pytest.mark.eight_ranks
def test_lora_2x2x2_trains_like_one_process():
    check_lora_pipe(run_on_ranks(8, train_lora_pipe, 2, 2, 1, timeout=600))


def check_lora_pipe(results) -> None:
    from tests.parity import test_pp_equivalence as pp
    tokens = pp.make_tokens(8)[:pp.STEPS * 8]
    ref = train_serial(apply_lora(pp.make_gpt(), seed=SEED, **LORA), [(b[:, :-1], b[:, 1:]) for b in tokens.split(8)],
                       "sgd", LR, CLIP)
    assert max(ref.clip_coefs) < 1.0
    pieces: dict[tuple, dict[str, list]] = {}
    for losses, norms, adapters, (p, d, t) in results:
        assert_losses_close(losses, ref.losses, rtol=1e-5)
        assert_norms_close(norms, ref.norms, rtol=1e-6)
        for name, (value, spec) in adapters.items():
            pieces.setdefault((d, name), []).append((t, value, spec))
    seen = set()
    for (d, name), parts in pieces.items():
        parts.sort(key=lambda x: x[0])
        spec = parts[0][2]
        whole = spec.merge([v for _, v, _ in parts]) if spec is not None and len(parts) > 1 else parts[0][1]
        assert_state_close({name: whole}, {name: ref.weights[name]}, rtol=1e-5)
        seen.add(name)
    assert seen == {k for k in ref.weights if "lora_" in k}
