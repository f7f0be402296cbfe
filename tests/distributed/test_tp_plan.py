"""`parallelize` on models written without trident, and the config entry point
`apply_tensor_parallel`: same losses and weights as the unsplit model, and errors that name
the module, the sizes and the fix."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trident.config.schema import TensorParallelConfig
from trident.models.gpt import GPT, GPTConfig
from trident.tensor_parallel import (
    ColumnParallelLinear,
    apply_tensor_parallel,
    merge_state_dicts,
    parallelize,
    shard_specs,
    tp_layers,
)
from trident.testing.distributed import cached_mesh, cached_solo_mesh, run_on_ranks
from trident.testing.parity import assert_losses_close, assert_state_close

STEPS, BATCH, SEQ, VOCAB, D = 10, 4, 8, 50, 32  # VOCAB is padded to 52 at tp=4


class GPT2Attention(nn.Module):
    """GPT-2's fused c_attn ([q | k | v]) and c_proj; heads read from the width of c_attn's output.

    c_attn has no bias: the key bias's exact gradient is zero (softmax ignores a shift), so its
    computed gradient is rounding noise that Adam scales up to full steps in any two runs.
    """

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.head_dim = d // heads
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in self.c_attn(x).chunk(3, dim=-1))
        return self.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))


class GPT2Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(d), GPT2Attention(d, heads), nn.LayerNorm(d)
        self.mlp = nn.ModuleDict({"c_fc": nn.Linear(d, 4 * d), "c_proj": nn.Linear(4 * d, d)})

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x))))


class GPT2Like(nn.Module):
    """HF GPT-2 module names (transformer.wte, transformer.h.N.attn.c_attn, ...), tied lm_head."""

    def __init__(self, layers: int = 2, heads: int = 4):
        super().__init__()
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(VOCAB, D), "wpe": nn.Embedding(SEQ, D),
            "h": nn.ModuleList(GPT2Block(D, heads) for _ in range(layers)), "ln_f": nn.LayerNorm(D)})
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx, targets):
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1]))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class LlamaLike(nn.Module):
    """HF LLaMA module names, grouped-query attention (4 query heads, 2 key/value heads), SwiGLU."""

    def __init__(self):
        super().__init__()
        hd = D // 4
        self.embed_tokens, self.norm = nn.Embedding(VOCAB, D), nn.RMSNorm(D)
        linear = functools.partial(nn.Linear, bias=False)
        self.self_attn = nn.ModuleDict({"q_proj": linear(D, D), "k_proj": linear(D, 2 * hd),
                                        "v_proj": linear(D, 2 * hd), "o_proj": linear(D, D)})
        self.mlp = nn.ModuleDict({"gate_proj": linear(D, 64), "up_proj": linear(D, 64), "down_proj": linear(64, D)})
        self.lm_head, self.head_dim = nn.Linear(D, VOCAB, bias=False), hd

    def forward(self, idx, targets):
        x = self.embed_tokens(idx)
        b, t, _ = x.shape
        a = self.self_attn
        h = self.norm(x)
        q, k, v = (p(h).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (a.q_proj, a.k_proj, a.v_proj))
        rep = q.shape[1] // k.shape[1]
        y = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
        x = x + a.o_proj(y.transpose(1, 2).reshape(b, t, -1))
        h = self.norm(x)
        x = x + self.mlp.down_proj(F.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))
        return F.cross_entropy(self.lm_head(x).reshape(-1, VOCAB), targets.reshape(-1))


class TwoLayerMLP(nn.Module):
    """The issue's probe: modules fc1 and fc2, nothing else."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x, y):
        return F.mse_loss(self.fc2(F.relu(self.fc1(x))), y)


MODELS = {"gpt2": GPT2Like, "llama": LlamaLike, "mlp": TwoLayerMLP}
PLANS = {"gpt2": "gpt2", "llama": "llama", "mlp": {"fc1": "column", "fc2": "row"}}


def batches(kind: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    if kind == "mlp":
        return [(torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 16, generator=g)) for _ in range(STEPS)]
    data = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def train(model: nn.Module, kind: str) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for x, y in batches(kind):
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def train_parallel(kind: str):
    mesh = cached_mesh(tp=dist.get_world_size())
    torch.manual_seed(0)
    model = parallelize(MODELS[kind](), PLANS[kind], mesh)
    layers = {name: type(m).__name__ for name, m in tp_layers(model)}
    losses = train(model, kind)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, state, shard_specs(model), layers


@pytest.mark.parametrize("kind,world", [("gpt2", 2), ("gpt2", 4), ("llama", 2), ("mlp", 2)])
def test_parallelize_matches_unsplit_model(kind, world):
    torch.manual_seed(0)
    serial = MODELS[kind]()
    ref_losses = train(serial, kind)
    results = run_on_ranks(world, train_parallel, kind)
    assert_losses_close(results[0][0], ref_losses, rtol=1e-5)
    assert_state_close(merge_state_dicts([r[1] for r in results], results[0][2]), serial.state_dict(), rtol=1e-5)
    layers = results[0][3]
    if kind == "gpt2":
        assert layers["transformer.wte"] == "VocabParallelEmbedding" and layers["lm_head"] == "ColumnParallelLinear"
        assert layers["transformer.h.1.attn.c_attn"] == "ColumnParallelLinear" and len(layers) == 10
    if kind == "mlp":
        assert layers == {"fc1": "ColumnParallelLinear", "fc2": "RowParallelLinear"}


def tied_shard_is_shared() -> bool:
    torch.manual_seed(0)
    model = parallelize(GPT2Like(), "gpt2", cached_mesh(tp=dist.get_world_size()))
    return model.lm_head.weight is model.transformer.wte.weight and model.lm_head.weight.shape == (13, D)


def test_tied_weights_stay_tied():
    assert run_on_ranks(4, tied_shard_is_shared) == [True] * 4  # 50 rows padded to 52: 13 per rank


def error_messages() -> dict[str, str]:
    mesh = cached_mesh(tp=2)
    attempts = {
        "no_match": lambda: parallelize(TwoLayerMLP(), {"fc3": "column"}, mesh),
        "wrong_type": lambda: parallelize(TwoLayerMLP(), {"fc1": "vocab"}, mesh),
        "indivisible": lambda: parallelize(nn.Sequential(nn.Linear(4, 33)), {"0": "column"}, mesh),
        "twice": lambda: parallelize(parallelize(TwoLayerMLP(), {"fc1": "column"}, mesh), {"fc1": "column"}, mesh),
        "heads": lambda: GPT(GPTConfig(vocab_size=11, seq_len=8, n_layer=1, n_head=3, d_model=24), mesh),
        "seq": lambda: GPT(GPTConfig(vocab_size=11, seq_len=7, n_layer=1, n_head=2, d_model=8), mesh,
                           sequence_parallel=True),
        "plain_no_plan": lambda: apply_tensor_parallel(TwoLayerMLP(), TensorParallelConfig(size=2), mesh),
        "size": lambda: apply_tensor_parallel(TwoLayerMLP(), TensorParallelConfig(size=4, plan="gpt2"), mesh),
        "sp_plan": lambda: apply_tensor_parallel(TwoLayerMLP(), TensorParallelConfig(
            size=2, sequence_parallel=True, plan={"fc1": "column"}), mesh),
        "other_mesh": lambda: apply_tensor_parallel(GPT(GPTConfig(vocab_size=11, seq_len=8, n_layer=1, n_head=2,
                                                                  d_model=8), cached_solo_mesh()),
                                                    TensorParallelConfig(size=2), mesh),
        "sp_mismatch": lambda: apply_tensor_parallel(GPT(GPTConfig(vocab_size=11, seq_len=8, n_layer=1, n_head=2,
                                                                   d_model=8), mesh),
                                                     TensorParallelConfig(size=2, sequence_parallel=True), mesh),
    }
    out = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            out[name] = "no error"
        except ValueError as err:
            out[name] = str(err)
    return out


def test_errors_name_the_module_sizes_and_fix():
    msgs = run_on_ranks(2, error_messages)[0]
    assert "patterns ['fc3'] match no module of TwoLayerMLP" in msgs["no_match"] and "'fc1'" in msgs["no_match"]
    assert "style 'vocab' for module 'fc1' needs a torch Embedding, but it is a Linear" in msgs["wrong_type"]
    assert "module '0'" in msgs["indivisible"] and "out_features=33" in msgs["indivisible"]
    assert "not divisible by tp=2" in msgs["indivisible"] and "pad_vocab=True" in msgs["indivisible"]
    assert "'fc1' is already a tensor-parallel ColumnParallelLinear" in msgs["twice"]
    assert "n_head=3 is not divisible by tensor_parallel.size=2" in msgs["heads"]
    assert "seq_len=7 is not divisible by tensor_parallel.size=2" in msgs["seq"]
    assert "has no trident tensor-parallel layers and tensor_parallel.plan is null" in msgs["plain_no_plan"]
    assert "tensor_parallel.size=4 but the mesh has tp=2" in msgs["size"]
    assert "a transformers model with plan 'hf' or 'auto'" in msgs["sp_plan"]
    assert "sequence_parallel=false" in msgs["sp_plan"]
    assert "built for tp=1" in msgs["other_mesh"] and "mesh has tp=2" in msgs["other_mesh"]
    assert "sequence_parallel=False but tensor_parallel.sequence_parallel=True" in msgs["sp_mismatch"]


def config_entry_point() -> dict[str, object]:
    """apply_tensor_parallel with a plan, and with plan null on trident's GPT (built plain)."""
    mesh = cached_mesh(tp=2)
    torch.manual_seed(0)
    mlp = apply_tensor_parallel(TwoLayerMLP(), TensorParallelConfig(size=2, plan={"fc1": "column", "fc2": "row"}),
                                mesh)
    gpt = apply_tensor_parallel(GPT(GPTConfig(vocab_size=11, seq_len=8, n_layer=1, n_head=2, d_model=8)),
                                TensorParallelConfig(size=2, sequence_parallel=True), mesh)
    again = apply_tensor_parallel(gpt, TensorParallelConfig(size=2, sequence_parallel=True), mesh)
    return {"mlp": isinstance(mlp.fc1, ColumnParallelLinear), "gpt_layers": len(tp_layers(gpt)),
            "gpt_sp": gpt.sequence_parallel, "idempotent": again is gpt and len(tp_layers(again)) == 6}


def test_apply_tensor_parallel_from_config():
    for result in run_on_ranks(2, config_entry_point):
        assert result == {"mlp": True, "gpt_layers": 6, "gpt_sp": True, "idempotent": True}
