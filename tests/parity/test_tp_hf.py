"""Unmodified `transformers` models split by tensor parallelism from config alone
(`tensor_parallel.plan: "hf"` / `"auto"`): same losses and merged weights as one process.

GPT-2 has transposed `Conv1D` weights, a fused `c_attn` split by heads and tied embeddings;
GPT-NeoX a fused `query_key_value` interleaved per head; LLaMA grouped-query attention (tied
and untied); Qwen2 biases on q, k and v. All tiny and fp32, built from configs.
"""

from __future__ import annotations

import pytest
import torch
import transformers
import trident
from tests.distributed.test_lora_export import CausalLMLoss
from tests.parity.test_pp_hf import SEQ, VOCAB
from tests.parity.test_pp_hf import make as make_lm
from trident.tensor_parallel import merge_state_dicts, shard_specs
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.parity import (assert_losses_close, assert_norms_close, assert_state_close,
                                    optimizer_section, train_serial)

STEPS, BATCH = 5, 4
SGD_LR, SGD_CLIP = 0.5, 0.05


def make(kind: str) -> CausalLMLoss:
    return CausalLMLoss(make_lm(kind))


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def train_rows(kind: str, config: dict, mesh):
    """An engine of model `kind` under `config` (the micro-batch filled in), each dp rank training
    on its rows of every batch; (engine, losses, global gradient norms)."""
    micro = BATCH // mesh.dp_size
    engine, *_ = trident.initialize(model=make(kind), config={"train_micro_batch_size_per_gpu": micro,
                                                              "steps_per_print": 0, **config}, mesh=mesh)
    losses, norms = [], []
    for batch in tokens().split(BATCH):
        engine.backward(engine(batch[mesh.dp_rank * micro:(mesh.dp_rank + 1) * micro]))
        engine.step()
        losses.append(engine.last_loss)
        norms.append(engine.get_global_grad_norm())
    return engine, losses, norms


def train_tp(kind: str, tp: int, plan: str, sequence_parallel: bool = False, stage: int = 0):
    """tp over `tp` ranks, dp over the rest of the world (each dp rank its rows of every batch)."""
    mesh = cached_mesh(tp=tp)
    cfg = {"gradient_clipping": SGD_CLIP, "optimizer": optimizer_section("sgd", SGD_LR),
           "zero_optimization": {"stage": stage},
           "tensor_parallel": {"size": tp, "plan": plan, "sequence_parallel": sequence_parallel}}
    engine, losses, norms = train_rows(kind, cfg, mesh)
    weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return losses, norms, weights, shard_specs(engine.module), mesh.dp_rank


@pytest.mark.parametrize("kind,plan,tp", [
    ("gpt2", "auto", 2), ("llama", "hf", 2), ("llama_tied", "auto", 2), ("qwen2", "hf", 2),
    ("qwen3", "hf", 2),  # per-head q/k norms: gradients summed over tp
    ("neox", "hf", 2), ("gpt2", "auto", 4), ("neox", "hf", 4),
    ("llama", "hf", 4), ("qwen2", "hf", 4),  # 2 key/value heads over tp 4: each replicated on 2 ranks
])
def test_transformers_model_under_tp_matches_one_process(kind, plan, tp):
    check_tp(kind, plan, tp, False)


@pytest.mark.parametrize("kind,plan", [("llama", "hf"), ("gpt2", "auto"), ("qwen3", "hf"), ("neox", "hf")])
def test_transformers_model_under_tp2_with_sequence_parallelism_matches_one_process(kind, plan):
    """Norms, MLPs and the residual stream on sequence shards; the sequence gathered in front of
    attention and by the output head."""
    check_tp(kind, plan, 2, True)


@pytest.mark.parametrize("kind,stage", [("llama", 1), ("llama", 3), ("gpt2", 1), ("qwen2", 3)])
def test_transformers_model_under_dp2_tp2_with_zero_matches_one_process(kind, stage):
    check_tp(kind, "auto", 2, False, world=4, stage=stage)


def check_tp(kind: str, plan: str, tp: int, sequence_parallel: bool, world: int | None = None, stage: int = 0):
    ref = train_serial(make(kind), [(b,) for b in tokens().split(BATCH)], "sgd", SGD_LR, SGD_CLIP)
    assert max(ref.clip_coefs) < 1.0
    results = run_on_ranks(world or tp, train_tp, kind, tp, plan, sequence_parallel, stage)
    dp_losses = {r[4]: r[0] for r in results}  # each dp rank reports its rows' loss; the batch's is the mean
    assert_losses_close([sum(s) / len(s) for s in zip(*dp_losses.values())], ref.losses, rtol=1e-5)
    for _, norms, _, _, _ in results:
        assert_norms_close(norms, ref.norms, rtol=1e-6)
    results = [r for r in results if r[4] == 0]  # one dp replica's tp shards
    merged = merge_state_dicts([r[2] for r in results], results[0][3])
    assert_state_close(merged, ref.weights, rtol=1e-5)
    assert results[0][3], "nothing was split"


def make_lm_with(**overrides) -> CausalLMLoss:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, intermediate_size=64, num_hidden_layers=2,
                                      max_position_embeddings=SEQ, **overrides)
    return CausalLMLoss(transformers.AutoModelForCausalLM.from_config(config).float())


def _bad_plans():
    errors = []
    cases = [
        (4, "hf", lambda: make_lm_with(num_attention_heads=8, num_key_value_heads=3,
                                       hidden_size=48)),  # 3 key/value heads over tp = 4
        (2, "auto", lambda: CausalLMLoss(transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(
            vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global"], 2]])))),
        (2, "hf", lambda: make("gpt2")),  # GPT-2 publishes no plan
        (2, {"layers.*.self_attn.qq_proj": "column"}, lambda: make("llama")),
    ]
    for tp, plan, build in cases:
        mesh = cached_mesh(tp=tp) if tp == 4 else cached_mesh(tp=2, dp=2)
        cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": optimizer_section("sgd", 0.1),
               "tensor_parallel": {"size": tp, "plan": plan}}
        try:
            trident.initialize(model=build(), config=cfg, mesh=mesh)
            errors.append(None)
        except ValueError as err:
            errors.append(str(err))
    return errors


def test_bad_plans_get_one_clear_error_each():
    for errors in run_on_ranks(4, _bad_plans):
        assert "LlamaAttention): 8 query heads over tensor_parallel.size=4 need tp to divide them, and 3 key/value " \
            "heads need tp to divide them or be a multiple of them" in errors[0], errors[0]
        assert "model_type 'gpt_neo') publishes no tensor-parallel plan and trident has no preset" in errors[1]
        assert "plan='hf': GPT2LMHeadModel (model_type 'gpt2') publishes no tensor-parallel plan" in errors[2]
        assert "['layers.*.self_attn.qq_proj'] match no module of CausalLMLoss" in errors[3]
