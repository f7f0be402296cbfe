"""LoRA on a real `transformers` LlamaForCausalLM split by the "llama" tensor-parallel plan
(grouped-query attention, SwiGLU MLP, tied nothing) trains like one process applying the same
LoRA: adapters on the plan's column-split q/k/v/gate/up and row-split o/down projections."""

from __future__ import annotations

import os

import pytest
import torch

import trident
from trident.peft import apply_lora
from trident.tensor_parallel import merge_state_dicts, shard_specs
from trident.testing.distributed import cached_mesh, run_on_ranks
from tests.distributed.test_lora_export import CausalLMLoss
from trident.testing.parity import assert_losses_close, assert_norms_close, assert_state_close, optimizer_section, \
    train_serial

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402  (a dev dependency: pyproject [dev])

STEPS, MICRO, SEED, LR, CLIP = 8, 4, 1234, 0.5, 0.05
LORA = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"]}


def make_llama() -> CausalLMLoss:
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64, max_position_embeddings=32,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    return CausalLMLoss(transformers.LlamaForCausalLM(cfg).float())


def tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (STEPS * MICRO, 16), generator=g)


def train_tp(tp: int):
    mesh = cached_mesh(tp=tp)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 0, "gradient_clipping": CLIP, "seed": SEED,
           "optimizer": optimizer_section("sgd", LR), "lora": LORA,
           "tensor_parallel": {"size": tp, "plan": "llama"}}
    engine, *_ = trident.initialize(model=make_llama(), config=cfg, mesh=mesh)
    data, losses, norms = tokens(), [], []
    for step in range(STEPS):
        batch = data[step * MICRO:(step + 1) * MICRO]
        engine.backward(engine(batch))
        engine.step()
        losses.append(engine.last_loss)
        norms.append(engine.get_global_grad_norm())
    adapters = {k: v.detach().clone() for k, v in engine.module.state_dict().items() if "lora_" in k}
    return losses, norms, adapters, shard_specs(engine.module)


def test_lora_on_a_tp2_split_transformers_llama_matches_one_process():
    data = tokens()
    ref = train_serial(apply_lora(make_llama(), seed=SEED, **LORA),
                       [(b,) for b in data.split(MICRO)], "sgd", LR, CLIP)
    assert max(ref.clip_coefs) < 1.0
    results = run_on_ranks(2, train_tp, 2)
    for losses, norms, _, _ in results:
        assert_losses_close(losses, ref.losses, rtol=1e-5)
        assert_norms_close(norms, ref.norms, rtol=1e-6)
    specs = {k: s for k, s in results[0][3].items() if "lora_" in k}
    assert specs, "no adapter is split over tp"
    merged = merge_state_dicts([r[2] for r in results], specs)
    assert_state_close(merged, {k: v for k, v in ref.weights.items() if "lora_" in k}, rtol=1e-5)
