"""Unmodified `transformers` decoder models split into pipeline stages (`trident.pipeline.from_hf`,
or `pipeline.stages` in the config): same losses, gradient norms and merged weights as one process
running the unmodified model.

LLaMA with grouped-query attention (tied and untied embeddings), GPT-2 (tied, Conv1D, learned
positions), Qwen2 (q/k/v biases) and GPT-NeoX; fp32, SGD + momentum with clipping active on every
step. pp=2 with 1F1B for each, every schedule on tied LLaMA, pp2 x tp2 with the "hf"/"auto" plan
applied per stage, and pp2 x tp2 x dp2 on LLaMA. Every rank reports its stage's weights under the
model's own state-dict names (`hf_state_dict`); tp slices are merged and each (pp, dp) replica is
compared with the serial model.
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from torch import nn

import trident
from tests.distributed.test_lora_export import CausalLMLoss
from trident.engine.pipeline_engine import PipelineEngine
from trident.pipeline import from_hf, hf_shard_specs, hf_state_dict, load_hf_state_dict
from trident.tensor_parallel import merge_state_dicts, parallelize
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.parity import (assert_losses_close, assert_norms_close, assert_state_close,
                                    optimizer_section, train_serial)

VOCAB, SEQ, STEPS, MICRO = 64, 16, 5, 2
SGD_LR, SGD_CLIP = 0.5, 0.05

_LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=SEQ)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**_LLAMA),
    "llama_tied": lambda: transformers.LlamaConfig(**_LLAMA, tie_word_embeddings=True),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "qwen2": lambda: transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=SEQ),
    "qwen3": lambda: transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             head_dim=8, max_position_embeddings=SEQ),  # per-head q/k norms
    "mistral": lambda: transformers.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                 max_position_embeddings=SEQ, sliding_window=8),
    "neox": lambda: transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=2, num_attention_heads=4,
                                              max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0),
    "mixtral": lambda: transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                 num_local_experts=4, num_experts_per_tok=2,
                                                 max_position_embeddings=SEQ),  # tests/parity/test_mixtral.py
    "olmo": lambda: transformers.OlmoConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                           max_position_embeddings=SEQ, clip_qkv=2.0, pad_token_id=None,
                                           eos_token_id=0),  # tests/parity/test_olmo.py, docs/models.md
}
TP_PLAN = {"llama": "hf", "llama_tied": "hf", "qwen2": "hf", "neox": "hf", "gpt2": "auto", "mixtral": "hf",
           "olmo": "hf"}


def make(kind: str, attn: str = "eager") -> nn.Module:
    torch.manual_seed(0)
    config = CONFIGS[kind]()
    config._attn_implementation = attn
    return transformers.AutoModelForCausalLM.from_config(config).float()


def tokens(global_batch: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (STEPS * global_batch, SEQ), generator=torch.Generator().manual_seed(3))


@functools.lru_cache(maxsize=None)
def serial(kind: str, global_batch: int):
    run = train_serial(CausalLMLoss(make(kind)), [(b,) for b in tokens(global_batch).split(global_batch)],
                       "sgd", SGD_LR, SGD_CLIP)
    run.weights = {k.removeprefix("lm."): v for k, v in run.weights.items()}
    return run


def train_pp(kind: str, pp: int, tp: int, schedule: str = "1f1b", v: int = 1, micro_batches: int = 2,
             explicit: bool = False, partition: str = "parameters", evaluate: bool = False):
    """On every rank: the model split over pp (and its stages over tp); `explicit` builds the stage
    with from_hf (and parallelize(stage, plan)) instead of letting trident.initialize do it."""
    mesh = cached_mesh(pp=pp, tp=tp)
    model = make(kind)
    tp_section = {"size": tp}
    if explicit:
        model = from_hf(model, pp, partition_method=partition, virtual_stages=v, stage_id=mesh.pp_rank)
        if tp > 1:
            parallelize(model, TP_PLAN[kind], mesh)
    elif tp > 1:
        tp_section["plan"] = TP_PLAN[kind]
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": micro_batches,
              "optimizer": optimizer_section("sgd", SGD_LR), "gradient_clipping": SGD_CLIP, "steps_per_print": 0,
              "pipeline": {"stages": pp, "schedule": schedule, "virtual_stages": v, "partition_method": partition},
              "tensor_parallel": tp_section}
    engine, *_ = trident.initialize(model=model, config=config, mesh=mesh)
    assert isinstance(engine, PipelineEngine)
    global_batch = MICRO * micro_batches * mesh.dp_size
    data, per_rank = tokens(global_batch), MICRO * micro_batches
    losses, norms = [], []
    for step in range(STEPS):
        mine = data[step * global_batch + mesh.dp_rank * per_rank:][:per_rank]
        batches = [(mine[k:k + MICRO], mine[k:k + MICRO]) for k in range(0, per_rank, MICRO)]
        losses.append(float(engine.train_batch(iter(batches))))
        norms.append(engine.get_global_grad_norm())
    weights = {k: t.detach().clone() for k, t in hf_state_dict(engine.module).items()}
    result = (losses, weights, hf_shard_specs(engine.module), (mesh.pp_rank, mesh.dp_rank, mesh.tp_rank), norms)
    if evaluate:  # the trained model's loss on the first batch, forward only
        result += (float(engine.eval_batch(iter([(b, b) for b in data[:global_batch].split(MICRO)]))),)
    return result


SPLIT = {  # tensors the tp plan must split, wherever a stage holds them (tied copies included)
    "llama": {"model.layers.0.self_attn.q_proj.weight", "model.layers.3.mlp.down_proj.weight", "lm_head.weight"},
    "llama_tied": {"model.embed_tokens.weight", "lm_head.weight", "model.layers.1.self_attn.k_proj.weight"},
    "gpt2": {"transformer.wte.weight", "lm_head.weight", "transformer.h.1.attn.c_attn.weight"},
}


def check(kind: str, results, global_batch: int, split: bool = False) -> None:
    ref = serial(kind, global_batch)
    assert max(ref.clip_coefs) < 1.0, f"clipping inactive on some step: {ref.clip_coefs}"
    replicas: dict[tuple, list] = {}
    for losses, weights, specs, (pp, dp, tp), norms, *evaluated in results:
        assert_losses_close(losses, ref.losses, rtol=1e-5)
        if evaluated:
            trained = make(kind)
            trained.load_state_dict(ref.weights)
            first = tokens(global_batch)[:global_batch]
            with torch.no_grad():
                expected = trained(input_ids=first, labels=first).loss
            assert_losses_close(evaluated, [expected.item()], rtol=1e-5)
        assert_norms_close(norms, ref.norms, rtol=1e-6)
        replicas.setdefault((pp, dp), []).append((tp, weights, specs))
        if split:
            assert SPLIT[kind] & weights.keys() <= specs.keys(), sorted(SPLIT[kind] & weights.keys() - specs.keys())
    covered = set()
    for ranks in replicas.values():
        ranks.sort(key=lambda r: r[0])
        weights = merge_state_dicts([w for _, w, _ in ranks], ranks[0][2]) if len(ranks) > 1 else ranks[0][1]
        assert_state_close(weights, {k: ref.weights[k] for k in weights}, rtol=1e-5)
        covered |= weights.keys()
    assert covered == set(ref.weights), sorted(covered ^ set(ref.weights))


@pytest.mark.parametrize("kind", ["llama", "llama_tied", "gpt2", "qwen2", "neox"])
def test_pp2_1f1b_from_config_matches_one_process(kind):
    """`pipeline.stages: 2` with the unmodified model passed to trident.initialize."""
    check(kind, run_on_ranks(2, train_pp, kind, 2, 1, evaluate=True), MICRO * 2)


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)])
def test_every_schedule_on_tied_llama(schedule, v):
    """The tied embedding crosses stages (and chunks) under every schedule; from_hf built explicitly."""
    check("llama_tied", run_on_ranks(2, train_pp, "llama_tied", 2, 1, schedule, v, 4, True, "type:DecoderLayer"),
          MICRO * 4)


@pytest.mark.parametrize("kind,explicit", [("llama", True), ("llama_tied", False), ("gpt2", False)])
def test_pp2_tp2_matches_one_process(kind, explicit):
    """Each stage split by the model's own tp plan ("hf"; GPT-2: "auto"), the tied embedding and
    head split by vocabulary on both stages."""
    check(kind, run_on_ranks(4, train_pp, kind, 2, 2, "1f1b", 1, 2, explicit), MICRO * 2, split=True)


@pytest.mark.eight_ranks
def test_pp2_tp2_dp2_llama_matches_one_process():
    check("llama", run_on_ranks(8, train_pp, "llama", 2, 2), MICRO * 2 * 2, split=True)


# -- single process: the split itself, and bad input ---------------------------------------------------

@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_stages_chained_give_the_models_loss_and_names(kind, attn):
    ids = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(0))
    ref = make(kind, attn)
    expected = ref(input_ids=ids, labels=ids).loss
    stages = [from_hf(make(kind, attn), 2, stage_id=s) for s in range(2)]
    loss = stages[1].loss_fn(stages[1].run_chunk(0, stages[0].run_chunk(0, ids)), ids)
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    names = set(hf_state_dict(stages[0])) | set(hf_state_dict(stages[1]))
    assert names == set(ref.state_dict())
    whole = from_hf(make(kind, attn), 1)
    assert set(hf_state_dict(whole)) == set(ref.state_dict())
    torch.testing.assert_close(whole.loss_fn(whole(ids), ids), expected, rtol=0, atol=0)


def test_other_stages_are_released_and_tied_copy_is_a_buffer():
    last = from_hf(make("llama_tied"), 2, stage_id=1, partition_method="type:DecoderLayer")
    assert not last.owns("embed")
    tied = last.tied_modules["embed"]
    assert tied.embed.weight is tied.head.weight and "weight" in tied.embed._buffers
    assert last.tied_tensors("embed") == [tied.embed.weight]
    last.to(torch.bfloat16)  # buffers are replaced module by module: the copy stays one tensor
    assert tied.embed.weight is tied.head.weight and tied.embed.weight.dtype == torch.bfloat16
    model = make("llama")
    first = from_hf(model, 2, stage_id=0, partition_method="type:DecoderLayer")
    assert model.model.layers[3].mlp.up_proj.weight.is_meta and model.lm_head.weight.is_meta
    assert not any(p.is_meta for p in first.parameters())


def test_partition_leaving_a_stage_without_decoder_layers_names_the_model():
    with pytest.raises(ValueError, match=r"from_hf\(LlamaForCausalLM\).*stage 1 without a decoder layer"):
        from_hf(make("llama"), 2, stage_id=0, partition_method="type:HFHead")
    with pytest.raises(ValueError, match=r"from_hf\(GPT2LMHeadModel\): 2 decoder layers \(transformer.h\) cannot "
                                         r"fill 4 stage"):
        from_hf(make("gpt2"), 4, stage_id=0)


def test_model_without_decoder_layers_names_the_model():
    config = transformers.LlamaConfig(**{**_LLAMA, "num_hidden_layers": 0})
    with pytest.raises(ValueError, match=r"from_hf\(LlamaForCausalLM\): no decoder layers found \(model.layers"):
        from_hf(transformers.LlamaForCausalLM(config), 2, stage_id=0)
    with pytest.raises(ValueError, match=r"from_hf: Linear is not \(and holds no\) transformers causal LM"):
        from_hf(nn.Linear(2, 2), 2, stage_id=0)


def test_load_hf_state_dict_puts_a_models_weights_into_its_stages():
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    ref = make("qwen2")
    torch.manual_seed(7)
    other = transformers.AutoModelForCausalLM.from_config(ref.config)
    stages = [from_hf(transformers.AutoModelForCausalLM.from_config(ref.config), 2, stage_id=s) for s in range(2)]
    for stage in stages:
        load_hf_state_dict(stage, ref.state_dict())
    loss = stages[1].loss_fn(stages[1].run_chunk(0, stages[0].run_chunk(0, ids)), ids)
    torch.testing.assert_close(loss, ref(input_ids=ids, labels=ids).loss, rtol=0, atol=0)
    with pytest.raises(KeyError, match="lacks"):
        load_hf_state_dict(stages[0], {k: v for k, v in other.state_dict().items() if "embed" not in k})
