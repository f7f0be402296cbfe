"""PipelineModule: what each stage builds, tied layers, chunks, and the GPT written as one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trident.models.gpt import GPT, GPTConfig
from trident.models.gpt_pipe import gpt_names, gpt_pipe, gpt_state_dict, load_gpt_state_dict
from trident.pipeline import LayerSpec, PipelineModule, TiedLayerSpec

BUILT: list[int] = []  # widths of the Recorders built on a real device


class Recorder(nn.Linear):
    def __init__(self, width: int) -> None:
        super().__init__(4, 4)
        if self.weight.device.type != "meta":  # partitioning counts parameters on the meta device
            BUILT.append(width)


def recorders(n: int) -> list[LayerSpec]:
    return [LayerSpec(Recorder, i) for i in range(n)]


def test_layer_specs_are_built_only_on_the_owning_stage():
    BUILT.clear()
    module = PipelineModule(recorders(6), num_stages=3, partition_method="uniform", stage_id=1)
    assert BUILT == [2, 3]
    assert [name for name, _ in module.named_children()] == ["tied_modules", "2", "3"]
    assert list(module.chunk_layers(0)) == [2, 3]


def test_interleaved_chunks_hold_every_stages_th_slice():
    module = PipelineModule(recorders(8), num_stages=2, virtual_stages=2, partition_method="uniform", stage_id=1)
    assert [list(module.chunk_layers(c)) for c in range(2)] == [[2, 3], [6, 7]]
    assert not module.is_first(0) and module.is_last(1) and not module.is_last(0)
    assert "stage 1 chunk 1: layers 6-7" in module.describe_partition()


def _tied_layers() -> list:
    head = TiedLayerSpec("emb", nn.Embedding, 10, 4, forward_fn=lambda emb, x: x @ emb.weight.t())
    return [TiedLayerSpec("emb", nn.Embedding, 10, 4), LayerSpec(nn.Linear, 4, 4),
            LayerSpec(nn.Linear, 4, 4), head]


def test_tied_layers_are_parameters_on_the_owner_and_buffers_on_the_other_holders():
    first = PipelineModule(_tied_layers(), num_stages=2, partition_method="uniform", stage_id=0)
    last = PipelineModule(_tied_layers(), num_stages=2, partition_method="uniform", stage_id=1)
    assert first.tied_stages == {"emb": [0, 1]} and first.owns("emb") and not last.owns("emb")
    assert [n for n, _ in first.named_parameters()] == ["tied_modules.emb.weight", "1.weight", "1.bias"]
    assert [n for n, _ in last.named_parameters()] == ["2.weight", "2.bias"]
    assert [n for n, _ in last.named_buffers()] == ["tied_modules.emb.weight"]
    assert last.tied_tensors("emb")[0] is last.tied_modules["emb"].weight


def test_a_single_stage_module_shares_the_tied_module_and_runs_forward():
    torch.manual_seed(0)
    module = PipelineModule(_tied_layers(), num_stages=1, partition_method="uniform")
    assert len(list(module.tied_modules["emb"].parameters())) == 1
    idx = torch.tensor([[1, 2, 3]])
    emb = module.tied_modules["emb"]
    expected = module._modules["2"](module._modules["1"](emb(idx))) @ emb.weight.t()
    torch.testing.assert_close(module(idx), expected)
    split = PipelineModule(_tied_layers(), num_stages=2, partition_method="uniform", stage_id=0)
    with pytest.raises(RuntimeError, match="split over 2 stages"):
        split(idx)


def test_activation_checkpointing_gives_the_same_gradients():
    layers = [LayerSpec(nn.Linear, 6, 6) for _ in range(5)]
    torch.manual_seed(0)
    plain = PipelineModule(layers, num_stages=1, partition_method="uniform")
    torch.manual_seed(0)
    ckpt = PipelineModule(layers, num_stages=1, partition_method="uniform", activation_checkpoint_interval=2)
    x = torch.randn(3, 6)
    for module in (plain, ckpt):
        module(x).square().sum().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_module_arguments_are_checked():
    with pytest.raises(ValueError, match="num_stages must be a positive integer"):
        PipelineModule(recorders(2), num_stages=0)
    with pytest.raises(ValueError, match=r"stage_id must be an integer in \[0, 2\)"):
        PipelineModule(recorders(2), num_stages=2, stage_id=2)
    with pytest.raises(TypeError, match="torch.nn.Module subclass"):
        LayerSpec(len)
    with pytest.raises(ValueError, match="must be a Python identifier"):
        TiedLayerSpec("a.b", nn.Linear, 2, 2)


CFG = GPTConfig(vocab_size=37, seq_len=8, n_layer=4, n_head=2, d_model=16, bias=True)


def test_gpt_pipe_computes_what_gpt_computes():
    torch.manual_seed(0)
    gpt = GPT(CFG)
    pipe = gpt_pipe(CFG, 1)
    load_gpt_state_dict(pipe, gpt.state_dict(), CFG)
    idx = torch.randint(0, CFG.vocab_size, (3, CFG.seq_len))
    torch.testing.assert_close(pipe(idx), gpt(idx), rtol=0, atol=0)
    assert pipe.loss_fn(pipe(idx), idx) == gpt(idx, idx)
    assert gpt_state_dict(pipe, CFG).keys() == gpt.state_dict().keys()


def test_gpt_pipe_stages_split_the_blocks_and_cover_every_weight():
    stages = [gpt_pipe(CFG, 2, stage_id=s) for s in range(2)]
    assert stages[0].parts == [0, 4, 8]  # embed, positions, 2 blocks | 2 blocks, ln_f, head
    torch.manual_seed(0)
    gpt = GPT(CFG)
    covered = set()
    for stage in stages:
        load_gpt_state_dict(stage, gpt.state_dict(), CFG)
        mine = gpt_state_dict(stage, CFG)
        covered |= mine.keys()
        for key, value in mine.items():
            torch.testing.assert_close(value, gpt.state_dict()[key], rtol=0, atol=0, msg=key)
    assert covered == set(gpt.state_dict()) == set(gpt_names(CFG))


def test_gpt_pipe_initialises_like_gpt():
    """Same rules (not the same draws): residual projections are scaled down, norms start at 1."""
    pipe = gpt_pipe(CFG, 1)
    state = gpt_state_dict(pipe, CFG)
    assert torch.all(state["blocks.0.ln_1.weight"] == 1) and torch.all(state["blocks.0.attn.qkv.bias"] == 0)
    ratio = state["blocks.0.attn.proj.weight"].std() / state["blocks.0.attn.qkv.weight"].std()
    assert 0.2 < ratio < 0.5  # 1 / sqrt(2 * 4) = 0.35


def test_gpt_pipe_without_tied_embeddings():
    cfg = GPTConfig(vocab_size=37, seq_len=8, n_layer=2, n_head=2, d_model=16, tie_embeddings=False)
    torch.manual_seed(0)
    gpt = GPT(cfg)
    pipe = gpt_pipe(cfg, 1)
    assert not pipe.tied_stages
    load_gpt_state_dict(pipe, gpt.state_dict(), cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    torch.testing.assert_close(pipe(idx), gpt(idx), rtol=0, atol=0)
