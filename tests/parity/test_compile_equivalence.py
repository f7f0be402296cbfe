"""`compile`: each block compiled with torch.compile (inductor) trains to the same losses and
weights as the same layout run eagerly (fp32, rtol 1e-5), under DP, ZeRO 1-3, tp=2, pp=2,
activation checkpointing and for a transformers LLaMA; the graph breaks per block are asserted,
and checkpoints keep their keys.

Each case runs eager and compiled in the same worker call on the same mesh. Inductor's first
compile of a block takes ~25 s on 2 cores; its FX graph cache (on disk) makes later runs of the
same graph take about a second, and every case here uses the same tiny GPT (2 layers, d_model
32), so most cases reuse the first one's kernels.

Graph breaks per block, and why:
- DP, ZeRO-1/2, pp, checkpointing, LLaMA: 0 (one graph per block; gradient reduction runs in
  hooks outside it).
- ZeRO-3: each module owning parameters has eager gather (pre) and release (post) hooks, and
  these are kept out of the graph (`torch._dynamo.disable`): ZERO3_BREAKS per block.
- tp=2: each tensor-parallel mapping (trident.tensor_parallel.mappings) runs eagerly, its
  collective behind trident's logger: TP_BREAKS per block.
"""

from __future__ import annotations

import pytest
import torch

import trident
from tests.parity.test_dp_equivalence import MODEL, OPT_LR, SGD_CLIP, make_tokens
from tests.parity.test_dp_equivalence import make_model as make_gpt
from trident.models.gpt import GPTConfig
from trident.models.gpt_pipe import gpt_pipe, gpt_state_dict, load_gpt_state_dict
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.parity import assert_losses_close, assert_norms_close, assert_state_close, optimizer_section

STEPS = 10  # of make_tokens' 20 steps of data
MICRO = 2
BLOCKS = ["blocks.0", "blocks.1"]  # MODEL: 2 layers, d_model 32, SGD_CLIP active on every step
ZERO3_BREAKS = 9  # 10 graphs: the compute of each of the 6 modules owning parameters between its
# eager gather and release hooks, the attention core, and the residual adds and activation around them
TP_BREAKS = 4  # one per mapping: copy into each column-parallel layer, all-reduce out of each row-parallel one


def make_config(compiled: bool, optimizer: str, clip: float, stage: int = 0, tp: int = 1, pp: int = 1,
                gas: int = 1, checkpoint: bool = False) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "optimizer": optimizer_section(optimizer, OPT_LR[optimizer]),
        "gradient_clipping": clip,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "tensor_parallel": {"size": tp},
        "pipeline": {"stages": pp, "partition_method": "uniform"},
        "activation_checkpointing": {"layers": [r"blocks\.\d+"] if checkpoint else []},
        "compile": {"enabled": compiled, "backend": "inductor"},
        "steps_per_print": 0,
    }


def train_flat(compiled: bool, optimizer: str, clip: float, stage: int = 0, tp: int = 1,
               checkpoint: bool = False, scope: str | None = None):
    """Runs on every rank: the GPT under dp (x tp); losses, norms, full weights, graph breaks."""
    mesh = cached_mesh(tp=tp)
    config = make_config(compiled, optimizer, clip, stage=stage, tp=tp, checkpoint=checkpoint)
    config["compile"]["scope"] = scope
    engine, *_ = trident.initialize(model=make_gpt(), config=config, mesh=mesh)
    global_batch = MICRO * mesh.dp_size
    data = make_tokens(global_batch)
    losses, norms = [], []
    for step in range(STEPS):
        batch = data[step * global_batch + mesh.dp_rank * MICRO:][:MICRO]
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))
        engine.step()
        losses.append(engine.last_loss)
        norms.append(engine.get_global_grad_norm())
    weights = {k: v.float() for k, v in engine.consolidated_state_dict().items()}
    return losses, norms, weights, _breaks(engine), clip


def train_pipe(compiled: bool, optimizer: str, clip: float):
    """Runs on every rank: the GPT as a 2-stage PipelineModule (1F1B, 2 micro-batches)."""
    mesh = cached_mesh(pp=2)
    cfg = GPTConfig(**MODEL)
    pipe = gpt_pipe(cfg, 2, partition_method="uniform", stage_id=mesh.pp_rank)
    load_gpt_state_dict(pipe, make_gpt().state_dict(), cfg)
    engine, *_ = trident.initialize(model=pipe, config=make_config(compiled, optimizer, clip, pp=2, gas=2),
                                    mesh=mesh)
    global_batch = MICRO * 2 * mesh.dp_size
    data = make_tokens(global_batch)
    losses, norms = [], []
    for step in range(STEPS):
        mine = data[step * global_batch:][:global_batch]
        batches = [(mine[k:k + MICRO, :-1], mine[k:k + MICRO, 1:]) for k in range(0, global_batch, MICRO)]
        losses.append(float(engine.train_batch(iter(batches))))
        norms.append(engine.get_global_grad_norm())
    weights = {k: v.detach().float().clone() for k, v in gpt_state_dict(pipe, cfg).items()}
    return losses, norms, weights, _breaks(engine), clip


def _breaks(engine):
    report = engine.compile_report
    return None if report is None else report.graph_breaks()


def eager_and_compiled(fn, *args, **kwargs):
    """Runs on every rank: the same training eager, then compiled."""
    return fn(False, *args, **kwargs), fn(True, *args, **kwargs)


def check_same(results, rtol: float = 1e-5):
    for eager, compiled in results:
        assert eager[3] is None
        clip = eager[4]
        assert not clip or min(eager[1]) > clip, f"clipping inactive on some step: norms {eager[1]}, clip {clip}"
        assert_losses_close(compiled[0], eager[0], rtol=rtol)
        assert_norms_close(compiled[1], eager[1], rtol=rtol)
        assert_state_close(compiled[2], eager[2], rtol=rtol)


def breaks_of(results) -> list[dict]:
    return [compiled[3] for _, compiled in results]


def run_case(fn, *args, **kwargs):
    """Eager and compiled on 2 ranks, compared; the graph breaks per block of each rank."""
    results = run_on_ranks(2, eager_and_compiled, fn, *args, timeout=600, **kwargs)
    check_same(results)
    return breaks_of(results)


@pytest.mark.parametrize("optimizer,clip", [("sgd", SGD_CLIP), ("adamw", 0.0)])
def test_dp_compiled_matches_eager(optimizer, clip):
    assert run_case(train_flat, optimizer, clip) == [dict.fromkeys(BLOCKS, 0)] * 2


@pytest.mark.parametrize("stage,breaks", [(1, 0), (2, 0), (3, ZERO3_BREAKS)])
def test_zero_compiled_matches_eager(stage, breaks):
    assert run_case(train_flat, "sgd", SGD_CLIP, stage=stage) == [dict.fromkeys(BLOCKS, breaks)] * 2


@pytest.mark.parametrize("stage", [0, 2])
def test_whole_model_compiled_matches_eager(stage):
    """scope "model" (what an unset scope picks on a GPU): one graph for the whole call, loss included."""
    assert run_case(train_flat, "sgd", SGD_CLIP, stage=stage, scope="model") == [{"": 0}] * 2


def test_tp2_compiled_matches_eager():
    assert run_case(train_flat, "sgd", SGD_CLIP, tp=2) == [dict.fromkeys(BLOCKS, TP_BREAKS)] * 2


def test_pp2_compiled_matches_eager():
    """Each stage compiles its own numbered layers (the GPT's blocks 1 and 2 of 4 layers)."""
    assert run_case(train_pipe, "sgd", SGD_CLIP) == [{"1": 0, "2": 0}, {"3": 0, "4": 0}]


def test_activation_checkpointing_compiled_matches_eager():
    """Checkpointed blocks: the recompute wrapper stays eager around the compiled forward."""
    assert run_case(train_flat, "sgd", SGD_CLIP, checkpoint=True) == [dict.fromkeys(BLOCKS, 0)] * 2


def train_hf(compiled: bool):
    """Runs on every rank: a 2-layer LLaMA from transformers under dp=2 (SGD, active clipping)."""
    import transformers
    from tests.distributed.test_lora_export import CausalLMLoss

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=MODEL["seq_len"])
    model = CausalLMLoss(transformers.AutoModelForCausalLM.from_config(config).float())
    mesh = cached_mesh()
    engine, *_ = trident.initialize(model=model, config=make_config(compiled, "sgd", SGD_CLIP), mesh=mesh)
    data = torch.randint(0, 64, (STEPS * MICRO * 2, MODEL["seq_len"]), generator=torch.Generator().manual_seed(3))
    losses, norms = [], []
    for batch in data.split(MICRO * 2):
        engine.backward(engine(batch[mesh.dp_rank * MICRO:][:MICRO]))
        engine.step()
        losses.append(engine.last_loss)
        norms.append(engine.get_global_grad_norm())
    weights = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    return losses, norms, weights, _breaks(engine), SGD_CLIP


def test_transformers_decoder_layers_compiled_match_eager():
    """Each LlamaDecoderLayer is a block; transformers writes them compile-friendly."""
    layers = ["lm.model.layers.0", "lm.model.layers.1"]
    assert run_case(train_hf) == [dict.fromkeys(layers, 0)] * 2


def save_compiled_load_eager(path: str):
    """Runs on one rank: a compiled engine's checkpoint, loaded by an eager one."""
    mesh = cached_mesh()
    compiled, *_ = trident.initialize(model=make_gpt(), config=make_config(True, "adamw", 0.0, stage=2), mesh=mesh)
    batch = make_tokens(MICRO)[:MICRO]
    compiled.backward(compiled(batch[:, :-1], batch[:, 1:]))
    compiled.step()
    compiled.save_checkpoint(path, tag="t")
    eager, *_ = trident.initialize(model=make_gpt(), config=make_config(False, "adamw", 0.0, stage=2), mesh=mesh)
    eager.load_checkpoint(path, tag="t")
    return (list(compiled.module.state_dict()), list(eager.module.state_dict()),
            compiled.consolidated_state_dict(), eager.consolidated_state_dict())


def test_checkpoints_keep_their_keys(tmp_path):
    (compiled_keys, eager_keys, compiled, eager), = run_on_ranks(1, save_compiled_load_eager, str(tmp_path))
    assert compiled_keys == eager_keys and not any("_orig_mod" in k for k in compiled_keys)
    assert_state_close(eager, compiled, rtol=0.0)


def refused_fullgraph(stage: int, tp: int) -> str:
    mesh = cached_mesh(tp=tp)
    config = make_config(True, "sgd", 0.0, stage=stage, tp=tp)
    config["compile"]["fullgraph"] = True
    try:
        trident.initialize(model=make_gpt(), config=config, mesh=mesh)
    except ValueError as err:
        return str(err)
    return "accepted"


@pytest.mark.parametrize("stage,tp,why", [(3, 1, "ZeRO-3's gather and release hooks"),
                                          (0, 2, "tensor-parallel layers")])
def test_fullgraph_is_refused_where_breaks_are_needed(stage, tp, why):
    for message in run_on_ranks(2, refused_fullgraph, stage, tp):
        assert message.startswith("compile.fullgraph is true, but blocks.0") and why in message
