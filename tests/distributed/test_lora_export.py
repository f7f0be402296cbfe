"""LoRA adapters exported for peft, and peft models trained by trident.

Export: a tiny transformers Llama trains with the config's `lora` section on 2 ranks (ZeRO-2,
ZeRO-3); `engine.save_adapters` writes peft's files, and `PeftModel.from_pretrained` on a fresh
base gives the logits of the trained trident model (its consolidated weights in one process).
Under tp 2 the reference GPT's exported adapters equal the serial LoRA run's (the reference of
tests/parity/test_lora_equivalence.py). A peft-wrapped Llama under DP and ZeRO 1-3 (and GPT-2, with its
Conv1D and tied embeddings, under ZeRO-2) trains to the losses, gradient norms and adapters of the
same peft model in one process, its base untouched.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from a model hub; set before transformers loads

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import trident
from trident.peft import apply_lora, save_adapters
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.parity import (assert_losses_close, assert_norms_close, assert_state_close, optimizer_section,
                                    train_serial)
from tests.parity import test_dp_equivalence as dp
from tests.parity import test_lora_equivalence as lora_parity

LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128)
LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
SEED, SEQ, MICRO, WORLD, STEPS = 1234, 12, 4, 2, 4
GLOBAL = MICRO * WORLD
LR, CLIP = 0.5, 0.05
# Both sides compute the same fp32 ops on the same weights; 1e-5 of the largest logit leaves room
# for a different summation order inside the attention kernels.
LOGIT_TOL = 1e-5


class CausalLMLoss(nn.Module):
    """The engine needs a scalar: this returns the language-model loss. The transformers model
    keeps its module paths under `lm.`, which `save_adapters` strips (it finds the PreTrainedModel)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, labels=ids).loss


def llama(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**LLAMA, **overrides}))


def peft_llama() -> CausalLMLoss:
    """peft's LoRA on the Llama; A is drawn from torch's generator right after the seeded base."""
    return CausalLMLoss(get_peft_model(llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])))


def peft_gpt2() -> CausalLMLoss:
    """peft's LoRA on a transformers GPT-2: its fused c_attn is a Conv1D (weight stored transposed,
    hence fan_in_fan_out), and its input and output embeddings are tied."""
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=LLAMA["vocab_size"], n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    return CausalLMLoss(get_peft_model(gpt2, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                                                        fan_in_fan_out=True)))


# (factory, adapted layers per block, clip below the adapters' gradient norm on every step)
PEFT_MODELS = {"llama": (peft_llama, 2, CLIP), "gpt2": (peft_gpt2, 1, 0.01)}


def make_tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, LLAMA["vocab_size"], (STEPS * GLOBAL, SEQ), generator=g)


def probe() -> torch.Tensor:
    return torch.randint(0, LLAMA["vocab_size"], (3, SEQ), generator=torch.Generator().manual_seed(2))


def config(zero: int, lora: dict | None) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 0, "gradient_clipping": CLIP, "seed": SEED,
           "optimizer": optimizer_section("sgd", LR),
           "zero_optimization": {"stage": zero, "reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 0}}
    if lora is not None:
        cfg["lora"] = lora
    return cfg


def train(engine, mesh) -> tuple[list[float], list[float | None]]:
    """STEPS steps on this rank's share of each global batch; the losses and gradient norms."""
    data, losses, norms = make_tokens(), [], []
    for step in range(STEPS):
        start = step * GLOBAL + mesh.dp_rank * MICRO
        engine.backward(engine(data[start:start + MICRO]))
        engine.step()
        losses.append(engine.last_loss)
        norms.append(engine.get_global_grad_norm())
    return losses, norms


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    diff = (actual - expected).abs().max().item()
    assert diff <= LOGIT_TOL * expected.abs().max().item(), (
        f"{what}: max |logit difference| {diff:.3e} (largest logit {expected.abs().max().item():.3f})")


# -- trident LoRA -> peft -------------------------------------------------------------------------

def train_llama_and_save(zero: int, save_dir: str):
    """Every rank: trident LoRA on the Llama from the config, a few steps, save_adapters."""
    mesh = cached_mesh()
    engine, *_ = trident.initialize(model=CausalLMLoss(llama()), config=config(zero, LORA), mesh=mesh)
    train(engine, mesh)
    engine.save_adapters(save_dir)
    return {k: v.float() for k, v in engine.consolidated_state_dict().items()}


@pytest.mark.parametrize("zero", [2, 3], ids=["dp2-zero2", "dp2-zero3"])
def test_saved_adapters_load_in_peft_with_the_trained_model_s_logits(zero, tmp_path):
    results = run_on_ranks(WORLD, train_llama_and_save, zero, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]

    trained = CausalLMLoss(llama())  # the trained trident model, in one process
    apply_lora(trained, seed=SEED, **LORA)
    trained.load_state_dict(results[0])
    moved = max(v.abs().max().item() for k, v in results[0].items() if k.endswith("lora_B"))
    assert moved > 1e-3, "training moved no adapter: the logits would agree without any export"

    config_file = json.loads((tmp_path / "adapter_config.json").read_text())
    assert {k: config_file[k] for k in ("peft_type", "r", "lora_alpha", "target_modules", "bias")} == {
        "peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "bias": "none"}
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert len(saved) == 2 * 2 * LLAMA["num_hidden_layers"]
    assert "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight" in saved

    peft_model = PeftModel.from_pretrained(llama(), str(tmp_path))
    trained.eval()
    peft_model.eval()
    with torch.no_grad():
        expected = trained.lm(input_ids=probe()).logits
        assert_logits_close(peft_model(input_ids=probe()).logits, expected, f"peft vs trident, ZeRO-{zero}")


def train_gpt_tp_and_save(zero: int, save_dir: str) -> None:
    """Every rank: the parity GPT with LoRA under tp 2, trained as test_lora_equivalence trains it."""
    mesh = cached_mesh(tp=2)
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 0, "gradient_clipping": lora_parity.CLIP,
           "seed": lora_parity.SEED, "optimizer": optimizer_section("sgd", lora_parity.LR), "lora": lora_parity.LORA,
           "zero_optimization": {"stage": zero, "stage3_param_persistence_threshold": 0},
           "tensor_parallel": {"size": 2}}
    engine, *_ = trident.initialize(model=dp.make_model(), config=cfg, mesh=mesh)
    dp.train_steps(engine, mesh, 4, 1)
    engine.save_adapters(save_dir)


@pytest.mark.parametrize("zero,world", [(0, 2), (3, 4)], ids=["tp2", "dp2-tp2-zero3"])
def test_tp2_export_holds_the_serial_run_s_whole_adapters(zero, world, tmp_path):
    ref = lora_parity.serial(4 * world // 2)
    run_on_ranks(world, train_gpt_tp_and_save, zero, str(tmp_path))
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    expected = {f"base_model.model.{k}.weight": v for k, v in ref.weights.items() if k.endswith(("lora_A", "lora_B"))}
    assert_state_close(saved, expected, rtol=1e-5)  # the parity test's tolerance for adapters after training
    config_file = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config_file["target_modules"] == sorted(lora_parity.LORA["target_modules"])


def test_biases_and_modules_to_save_load_in_peft(tmp_path):
    """One process: trainable adapted-layer biases and a head trained whole reach peft's keys."""
    model = CausalLMLoss(llama(attention_bias=True))
    apply_lora(model, seed=SEED, bias="lora_only", modules_to_save=["lm_head"], **LORA)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    save_adapters(model, tmp_path, base_model_name_or_path="tiny-llama")
    config_file = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config_file["bias"], config_file["modules_to_save"], config_file["base_model_name_or_path"]) == (
        "lora_only", ["lm_head"], "tiny-llama")
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert {"base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias",
            "base_model.model.lm_head.weight"} <= set(saved)
    peft_model = PeftModel.from_pretrained(llama(attention_bias=True), str(tmp_path))
    with torch.no_grad():
        assert_logits_close(peft_model(input_ids=probe()).logits, model.lm(input_ids=probe()).logits,
                            "peft vs trident with biases and lm_head")


def test_prefix_names_the_module_peft_wraps(tmp_path):
    model = apply_lora(CausalLMLoss(llama()), seed=SEED, **LORA)
    save_adapters(model, tmp_path / "found")
    save_adapters(model, tmp_path / "lm", prefix="lm")
    save_adapters(model, tmp_path / "whole", prefix="")
    found, lm, whole = (load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in ("found", "lm", "whole"))
    assert list(found) == list(lm) and all(torch.equal(found[k], lm[k]) for k in found)
    assert sorted(whole) == sorted(k.replace("base_model.model.", "base_model.model.lm.") for k in found)


def test_save_adapters_refuses_a_model_without_trident_adapters(tmp_path):
    with pytest.raises(ValueError, match="no trident LoRA adapters.*holds a peft model: save that with its own save_pretrained"):
        save_adapters(peft_llama(), tmp_path)
    with pytest.raises(ValueError, match="no trident LoRA adapters.*`lora` section"):
        save_adapters(CausalLMLoss(llama()), tmp_path)
    assert not any(tmp_path.iterdir())


# -- peft models under ZeRO ----------------------------------------------------------------------

def train_peft_model(kind: str, stage: int):
    """Every rank: a peft-wrapped transformers model (no `lora` section) under ZeRO `stage`."""
    mesh = cached_mesh()
    factory, _, clip = PEFT_MODELS[kind]
    model = factory()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    engine, *_ = trident.initialize(model=model, config={**config(stage, None), "gradient_clipping": clip}, mesh=mesh)
    losses, norms = train(engine, mesh)
    weights = {k: v.float() for k, v in engine.consolidated_state_dict().items()}
    return dict(losses=losses, norms=norms, weights=weights, start=start, memory=engine.memory_breakdown())


@pytest.mark.parametrize("kind,stage", [("llama", 0), ("llama", 1), ("llama", 2), ("llama", 3), ("gpt2", 2)])
def test_peft_model_under_zero_trains_like_one_process(kind, stage):
    factory, per_block, clip = PEFT_MODELS[kind]
    batches = [(b,) for b in make_tokens().split(GLOBAL)]
    ref = train_serial(factory(), batches, "sgd", LR, clip)
    assert max(ref.clip_coefs) < 1.0, f"clipping inactive on some step: {ref.clip_coefs}"
    results = run_on_ranks(WORLD, train_peft_model, kind, stage)
    assert_losses_close([sum(s) / WORLD for s in zip(*(r["losses"] for r in results))], ref.losses, rtol=1e-5)
    adapters = {k for k in ref.weights if ".lora_" in k}
    assert len(adapters) == 2 * per_block * 2  # A and B per adapted layer, 2 blocks
    numel = sum(ref.weights[k].numel() for k in adapters)
    for r in results:
        assert_norms_close(r["norms"], ref.norms, rtol=1e-6)
        assert_state_close(r["weights"], ref.weights, rtol=1e-5)
        for k, v in r["start"].items():
            if k not in adapters:
                assert torch.equal(r["weights"][k], v), f"frozen {k} moved"
        # fp32 gradients of the adapters only (split over the 2 dp ranks from ZeRO-2 on)
        assert r["memory"]["gradients"] == pytest.approx(4 * numel / (WORLD if stage >= 2 else 1), rel=0.05)
