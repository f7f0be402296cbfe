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


def train_lora(zero: dict, tp: int):
    mesh = cached_mesh(tp=tp)
    base = dp.make_model()
    start = {k: v.clone() for k, v in base.state_dict().items()}
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 0, "gradient_clipping": CLIP, "seed": SEED,
           "optimizer": optimizer_section("sgd", LR), "comms_logger": {"enabled": True}, "lora": LORA,
           "zero_optimization": {"reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 0, **zero},
           "tensor_parallel": {"size": tp}}
    engine, *_ = trident.initialize(model=base, config=cfg, mesh=mesh)
    engine.comms_logger.reset()
    losses, norms = dp.train_steps(engine, mesh, 4, 1)
    traffic = {op: s.bytes / dp.STEPS for op, s in engine.comms_logger.totals().items()}
    weights = {k: v.float() for k, v in engine.consolidated_state_dict().items()}
    local_adapters = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    return dict(losses=losses, norms=norms, weights=weights, specs=shard_specs(engine.module), start=start,
                memory=engine.memory_breakdown(), traffic=traffic, local=local_adapters,
                dp=mesh.dp_rank, tp=mesh.tp_rank)


LAYOUTS = {
    "dp2-stage0": ({"stage": 0}, 1, 2),
    "dp2-zero1": ({"stage": 1}, 1, 2),
    "dp2-zero2": ({"stage": 2}, 1, 2),
    "dp2-zero3": ({"stage": 3}, 1, 2),
    "tp2": ({"stage": 0}, 2, 2),
    "dp2-tp2-zero1": ({"stage": 1}, 2, 4),
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
        if tp == 1:  # gradient bytes on the wire per step: the adapters' (padded to dp under ZeRO)
            sent = r["traffic"].get("all_reduce", 0) + r["traffic"].get("reduce_scatter", 0)
            assert sent == pytest.approx(4 * adapters, rel=0.05)


def test_bad_lora_input_is_named():
    with pytest.raises(ValueError, match=r"lora.target_modules: \['nope'\] match no module"):
        apply_lora(dp.make_model(), target_modules=["qkv", "nope"])
    with pytest.raises(ValueError, match="lora.r must be a positive integer"):
        apply_lora(dp.make_model(), r=0)
    with pytest.raises(ValueError, match="'embed.wte' is a Embedding"):
        apply_lora(dp.make_model(), target_modules=["wte"])
