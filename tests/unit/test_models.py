"""The reference GPT and the toy models: shapes, init, causality, and the head layout that
tensor parallelism relies on."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from trident.models.gpt import GPT, GPT_PRESETS, GPTConfig
from trident.models.toy import TinyMLP, make_regression_data

TINY = dict(vocab_size=97, seq_len=16, n_layer=2, n_head=4, d_model=32)


def make(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, **overrides}))


def tokens(batch: int = 2, length: int = 16, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY["vocab_size"], (batch, length), generator=g)


def test_forward_shapes_and_loss_at_init():
    model = make().eval()
    idx = tokens()
    assert model(idx).shape == (2, 16, 97)
    assert model(idx[:, :5]).shape == (2, 5, 97)
    loss = model(idx, tokens(seed=2))
    assert loss.dim() == 0
    # small init -> near-uniform predictions -> loss close to ln(vocab)
    assert abs(loss.item() - math.log(97)) < 0.05
    with pytest.raises(ValueError, match="seq_len is 16"):
        model(tokens(length=17))


def test_loss_is_mean_cross_entropy_of_logits():
    model = make().eval()
    idx, tgt = tokens(), tokens(seed=2)
    expected = F.cross_entropy(model(idx).reshape(-1, 97), tgt.reshape(-1))
    torch.testing.assert_close(model(idx, tgt), expected)


def test_tied_weights_share_storage():
    tied = make()
    assert tied.lm_head.weight.data_ptr() == tied.embed.wte.weight.data_ptr()
    assert tied.lm_head.weight is tied.embed.wte.weight
    untied = make(tie_embeddings=False)
    assert untied.lm_head.weight.data_ptr() != untied.embed.wte.weight.data_ptr()
    assert untied.num_parameters() - tied.num_parameters() == 97 * 32


def test_init_is_deterministic_and_scaled():
    a, b, c = make(seed=0), make(seed=0), make(seed=1)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.embed.wte.weight, c.embed.wte.weight)
    big = make(d_model=128, n_head=4, n_layer=8)
    # GPT-2: residual projections get std / sqrt(2 * n_layer); 16k samples -> ~1% estimate error
    assert big.blocks[0].attn.proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert big.blocks[0].mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.all(big.blocks[0].ln_1.weight == 1) and torch.all(big.blocks[0].attn.qkv.bias == 0)


def test_attention_is_causal():
    model = make().eval()
    idx = tokens()
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 97
    before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10], rtol=0, atol=0)
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_qkv_layout_keeps_whole_heads_in_contiguous_slices():
    """Column-splitting qkv and row-splitting proj into 2 shards, then summing, gives the full
    attention output: what tensor parallelism will do with these layers."""
    torch.manual_seed(0)
    attn = make().blocks[0].attn.eval()
    x = torch.randn(2, 16, 32)
    full = attn(x)
    out = attn.proj.bias.clone()
    width = attn.qkv.out_features // 2
    for s in range(2):
        rows = slice(s * width, (s + 1) * width)
        q, k, v = attn.split_heads(F.linear(x, attn.qkv.weight[rows], attn.qkv.bias[rows]))
        assert q.shape == (2, 2, 16, 8)  # 2 of the 4 heads
        y = attn.merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        out = out + F.linear(y, attn.proj.weight[:, s * 16:(s + 1) * 16])
    torch.testing.assert_close(out, full)


def test_dropout_only_in_training():
    model = make(dropout=0.5)
    idx = tokens()
    model.eval()
    torch.testing.assert_close(model(idx), model(idx))
    model.train()
    assert not torch.allclose(model(idx), model(idx))


def test_parameter_counts_and_presets():
    model = make()
    d, v, t, L = 32, 97, 16, 2
    per_block = (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d) + 4 * d
    assert model.num_parameters() == v * d + t * d + L * per_block + 2 * d
    assert model.num_parameters(exclude_embeddings=True) == L * per_block + 2 * d
    assert set(GPT_PRESETS) >= {"tiny", "demo", "small", "gpt2-124m"}
    with torch.device("meta"):
        gpt2 = GPT(GPTConfig(vocab_size=50257, **GPT_PRESETS["gpt2-124m"]))
    assert gpt2.num_parameters() == 124_439_808  # GPT-2 small with tied embeddings
    tiny = GPT(GPTConfig(vocab_size=4096, **GPT_PRESETS["tiny"]))
    assert tiny(torch.zeros(1, 64, dtype=torch.long)).shape == (1, 64, 4096)


def test_config_validation():
    with pytest.raises(ValueError, match="d_model=30 is not divisible by n_head=4"):
        GPTConfig(**{**TINY, "d_model": 30})
    with pytest.raises(ValueError, match="n_layer must be >= 1"):
        GPTConfig(**{**TINY, "n_layer": 0})
    assert GPTConfig(**TINY).ff_dim == 128
    assert GPTConfig(**TINY, d_ff=48).ff_dim == 48


def test_tiny_mlp_and_regression_data():
    x, y = make_regression_data(8, 16, 16, seed=3)
    x2, y2 = make_regression_data(8, 16, 16, seed=3)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, make_regression_data(8, 16, 16, seed=4)[0])
    torch.manual_seed(0)
    model = TinyMLP()
    assert len(model.layers) == 2 and model(x).shape == (8, 16)
    torch.testing.assert_close(model(x, y), F.mse_loss(model(x), y))
    assert len(TinyMLP(n_layers=4).layers) == 4
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    first = model(x, y).item()
    for _ in range(20):
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
    assert model(x, y).item() < first / 2  # the data has a learnable signal


def test_packed_documents_match_unpacked():
    """Two documents packed in one row with restarting positions and a document mask give the
    logits and gradients of each document run alone."""
    from trident.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, seq_len=16, n_layer=2, n_head=2, d_model=32))
    a, b = torch.randint(0, 50, (1, 7)), torch.randint(0, 50, (1, 9))
    packed = torch.cat([a, b], dim=1)
    positions = torch.cat([torch.arange(7), torch.arange(9)]).unsqueeze(0)
    docs = torch.cat([torch.zeros(7, dtype=torch.long), torch.ones(9, dtype=torch.long)]).unsqueeze(0)
    logits = model(packed, position_ids=positions, doc_ids=docs)
    torch.testing.assert_close(logits[:, :7], model(a), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits[:, 7:], model(b), rtol=1e-5, atol=1e-6)
