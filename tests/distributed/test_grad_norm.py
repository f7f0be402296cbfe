"""The global gradient norm under every strategy, on planted gradients whose norm is known in
closed form.

A hook on every parameter replaces its gradient with a constant c_k (1, 1.5, 2 or 2.5 by the
parameter's index in the serial model: exact in every float format, and a shard credited to
the wrong parameter changes the sum). Every data-parallel rank plants the same values, so the
averaged gradient is c_k too and the serial norm is sqrt(sum_k c_k^2 numel_k) over the unique
parameters of the unsplit model. Each element must be counted exactly once whatever holds it:
ZeRO shards and their zero padding, persistent (unpartitioned) stage-3 parameters, tp slices,
tp-replicated layer norms and biases, the tied input/output embedding, pipeline stages, and
parameter-server shards.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import trident
from trident.models.gpt import GPT, GPTConfig
from trident.models.gpt_pipe import gpt_pipe, load_gpt_state_dict
from trident.parameter_server import serve
from trident.testing.distributed import cached_mesh, run_on_ranks

# vocab divisible by tp (no padded rows, whose true gradient is zero, would get a planted value);
# biases on, so row-parallel output biases are tp-replicated; tied embeddings.
MODEL = dict(vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=16, dropout=0.0, bias=True)
MICRO = 2
NORM_RTOL = 1e-8
"""The norm sums fp32 rows of 1024 squares in float64 (trident.optim.clipping): each row's fp32
norm is rounded once (~1e-7), averaged over the rows. One element counted twice or missed moves
this model's norm by >= 3e-5, so the bar still sees every miscounted element."""


def plant_value(index: int) -> float:
    return 1.0 + 0.5 * (index % 4)


def make_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**MODEL))


def expected_norm() -> float:
    """sqrt(sum c_k^2 numel_k) over the serial model's unique parameters (the tied table once)."""
    return math.sqrt(sum(plant_value(k) ** 2 * p.numel() for k, p in enumerate(make_gpt().parameters())))


def plant(model: torch.nn.Module, values: dict[str, float]) -> None:
    """Every parameter named in `values` gets that constant as its gradient on every backward."""
    for name, p in model.named_parameters():
        p.register_hook(lambda g, c=values[name]: torch.full_like(g, c))


def serial_values() -> dict[str, float]:
    return {n: plant_value(k) for k, (n, _) in enumerate(make_gpt().named_parameters())}


def tokens(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    t = torch.randint(0, MODEL["vocab_size"], (MICRO, MODEL["seq_len"] + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def engine_norm(zero: dict, tp: int = 1, sequence_parallel: bool = False, precision: str = "fp32") -> float:
    """Runs on every rank: one planted step of the plain GPT under the layout; the engine's norm."""
    mesh = cached_mesh(tp=tp)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 0, "gradient_clipping": 1.0,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": zero,
           "bf16": {"enabled": precision == "bf16"},
           "tensor_parallel": {"size": tp, "sequence_parallel": sequence_parallel}}
    engine, *_ = trident.initialize(model=make_gpt(), config=cfg, mesh=mesh)
    plant(engine.module, serial_values())
    try:
        engine.backward(engine(*tokens(mesh.dp_rank)))
        engine.step()
        return engine.get_global_grad_norm()
    finally:
        getattr(engine.reducer, "close", lambda: None)()


STRATEGIES = {
    "stage0": ({"stage": 0, "reduce_bucket_size": 500}, 1, False),
    "zero1": ({"stage": 1, "reduce_bucket_size": 500, "sub_group_size": 300}, 1, False),
    "zero2": ({"stage": 2, "reduce_bucket_size": 500, "sub_group_size": 300}, 1, False),
    "zero3-persistent": ({"stage": 3, "stage3_param_persistence_threshold": 100, "reduce_bucket_size": 500}, 1, False),
    "zero3-all-partitioned": ({"stage": 3, "stage3_param_persistence_threshold": 0}, 1, False),
    "zero3-offload": ({"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
                      1, False),
    "tp2": ({"stage": 0}, 2, False),
    "tp2-sp": ({"stage": 0}, 2, True),
    "tp2-zero1": ({"stage": 1}, 2, False),
}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_planted_gradients_give_the_closed_form_norm(name):
    zero, tp, sp = STRATEGIES[name]
    world = 4 if tp > 1 and zero["stage"] else 2
    norms = run_on_ranks(world, engine_norm, zero, tp, sp)
    for norm in norms:
        assert norm == pytest.approx(expected_norm(), rel=NORM_RTOL)


@pytest.mark.parametrize("stage", [0, 3])
def test_planted_bf16_gradients_give_the_closed_form_norm(stage):
    for norm in run_on_ranks(2, engine_norm, {"stage": stage}, 1, False, "bf16"):
        assert norm == pytest.approx(expected_norm(), rel=NORM_RTOL)


def _two_micro_batches_of_half():
    """A hook that makes each of the two micro-batches' backward give 0.5 (accumulating to 1), then
    lets later gradients through: the owner of the tied table receives its copies' gradient by
    one more backward through autograd, which must arrive unchanged."""
    calls = [0]

    def hook(g):
        calls[0] += 1
        return torch.full_like(g, 0.5) if calls[0] <= 2 else g
    return hook


def pipe_norm(zero_stage: int) -> tuple[float, float]:
    """pp=2 (dp = world / 2): every parameter and tied copy planted with 1. The tied table's
    gradient is the sum of its two stages' (2 per element) and counts once: the closed form is
    sqrt(untied elements + 4 x table elements)."""
    mesh = cached_mesh(pp=2)
    cfg = GPTConfig(**MODEL)
    pipe = gpt_pipe(cfg, 2, partition_method="uniform", stage_id=mesh.pp_rank)
    load_gpt_state_dict(pipe, make_gpt().state_dict(), cfg)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 2, "steps_per_print": 0,
              "gradient_clipping": 1.0, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": zero_stage},
              "pipeline": {"stages": 2, "schedule": "1f1b", "partition_method": "uniform"}}
    engine, *_ = trident.initialize(model=pipe, config=config, mesh=mesh)
    planted = {id(t): t for t in list(pipe.parameters()) + list(pipe.buffers()) if t.requires_grad}
    for t in planted.values():
        t.register_hook(_two_micro_batches_of_half())
    engine.train_batch(iter([tokens(mesh.dp_rank), tokens(mesh.dp_rank + 7)]))
    table = make_gpt().embed.wte.weight.numel()
    untied = sum(p.numel() for p in make_gpt().parameters()) - table
    return engine.get_global_grad_norm(), math.sqrt(untied + 4 * table)


@pytest.mark.parametrize("world,zero_stage", [(2, 0), (4, 1)])
def test_planted_pipeline_gradients_count_the_tied_table_once(world, zero_stage):
    for norm, expected in run_on_ranks(world, pipe_norm, zero_stage):
        assert norm == pytest.approx(expected, rel=NORM_RTOL)


def ps_norm() -> float | None:
    """2 servers, 2 sync workers: the servers sum their shards' squared norms."""
    mesh = cached_mesh()
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 0, "gradient_clipping": 1.0,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 0, "reduce_bucket_size": 500},
           "parameter_server": {"servers": 2, "mode": "sync"}}
    if dist.get_rank() < 2:
        serve(cfg, make_gpt(), mesh=mesh)
        return None
    engine, *_ = trident.initialize(model=make_gpt(), config=cfg, mesh=mesh)
    plant(engine.module, serial_values())
    engine.backward(engine(*tokens(engine.dp_rank)))
    engine.step()
    norm = engine.get_global_grad_norm()
    engine.close()
    return norm


def test_planted_parameter_server_gradients_give_the_closed_form_norm():
    norms = [n for n in run_on_ranks(4, ps_norm) if n is not None]
    assert len(norms) == 2
    for norm in norms:
        assert norm == pytest.approx(expected_norm(), rel=NORM_RTOL)


class Wide(torch.nn.Module):
    """4.2M parameters in one matrix and a bias: the size of the demo GPT's flat gradient, where
    a float32 running sum of squares loses about 1e-4 of the norm."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2048, 2048)

    def forward(self, x):
        return self.fc(x).square().mean()


def random_gradients() -> dict[str, torch.Tensor]:
    """The same heavy-tailed gradient on every rank (so also its dp average), per parameter."""
    g = torch.Generator().manual_seed(3)
    return {n: torch.randn(p.shape, generator=g) * torch.rand(p.shape, generator=g) ** 4
            for n, p in Wide().named_parameters()}


def wide_norm(stage: int) -> float:
    mesh = cached_mesh()
    cfg = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 0, "gradient_clipping": 1.0,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 1_000_000, "sub_group_size": 1_500_000}}
    engine, *_ = trident.initialize(model=Wide(), config=cfg, mesh=mesh)
    for name, p in engine.module.named_parameters():
        p.register_hook(lambda g, planted=random_gradients()[name]: planted.to(g.dtype).reshape(g.shape))
    engine.backward(engine(torch.ones(1, 2048)))
    engine.step()
    return engine.get_global_grad_norm()


def test_a_large_gradient_norm_is_the_same_under_every_partitioning():
    """Whole flat buffer (stage 0), shards (1) or gathered units (3) of a heavy-tailed 4M-element
    gradient: the norms agree to 1e-9, so every layout clips by the same coefficient, and each
    is within 1e-7 of the float64 norm (fp32 rows of 1024 on this CPU carry a ~2e-8 downward
    bias; torch's fp32 norm of the whole buffer is 4e-5 off)."""
    expected = math.sqrt(sum(float(g.double().square().sum()) for g in random_gradients().values()))
    norms = [norm for stage in (0, 1, 3) for norm in run_on_ranks(2, wide_norm, stage)]
    for norm in norms:
        assert norm == pytest.approx(norms[0], rel=1e-9)
        assert norm == pytest.approx(expected, rel=1e-7)
