"""A step's host work, counted (issue: on a GPU, a step costs what the model costs).

On a GPU every operator is a kernel launch the host issues and every host read of a device value
stalls it; on this CPU neither shows as time, so they are counted with
`trident.monitor.step_cost.StepCost` over one whole training step (forward, backward, optimizer
step) on 2 gloo ranks, for every strategy and layout, in fp32 and bf16. Three rules:

- the operator count does not grow with parameter size: the same model with every tensor 64x
  larger (d_model 64 -> 512) dispatches at most 2% more operators;
- it is at most 1.3x a plain PyTorch loop's on the same model (forward, backward,
  `clip_grad_norm_(foreach=True)`, foreach AdamW);
- one host sync a step at most (the gradient norm's read).
"""

from __future__ import annotations

import pytest
import torch

import trident
from trident.models.gpt import GPT, GPTConfig
from trident.models.gpt_pipe import gpt_pipe
from trident.monitor.step_cost import StepCost
from trident.testing.distributed import cached_mesh, run_on_ranks

VOCAB, SEQ, LAYERS, HEADS, MICRO = 128, 16, 2, 4, 2
MAX_GROWTH, MAX_OVER_PLAIN, MAX_SYNCS = 1.02, 1.3, 1


def _batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    return x, torch.roll(x, -1, 1)


def _config(d_model: int) -> GPTConfig:
    return GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=LAYERS, n_head=HEADS, d_model=d_model)


def _counted(step) -> StepCost:
    """Two warm-up steps (optimizer state, the ZeRO-3 trace), then one counted."""
    for _ in range(2):
        step()
    with StepCost() as cost:
        step()
    return cost


def _plain(d_model: int, micro_batches: int = 1, mesh=None) -> StepCost:
    """The reference: plain PyTorch on the same model (tp-sharded when `mesh` splits it)."""
    torch.manual_seed(0)
    model = GPT(_config(d_model), mesh) if mesh is not None else GPT(_config(d_model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x, y = _batch()

    def step():
        for _ in range(micro_batches):
            (model(x, y) / micro_batches).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad()
    return _counted(step)


def _section(layout: str, bf16: bool) -> dict:
    zero = {"stage": {"stage0": 0, "zero1": 1, "zero2": 2, "zero3": 3, "offload": 2}.get(layout, 0)}
    if layout == "offload":
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 2 if layout == "pp2" else 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "gradient_clipping": 1.0,
           "zero_optimization": zero, "bf16": {"enabled": bf16}, "steps_per_print": 0}
    if layout == "tp2":
        cfg["tensor_parallel"] = {"size": 2}
    if layout == "pp2":
        cfg["pipeline"] = {"stages": 2, "schedule": "1f1b", "partition_method": "uniform"}
    return cfg


def _trident(layout: str, d_model: int, bf16: bool) -> StepCost:
    torch.manual_seed(0)
    x, y = _batch()
    if layout == "pp2":
        mesh = cached_mesh(pp=2)
        model = gpt_pipe(_config(d_model), 2, partition_method="uniform", stage_id=mesh.pp_rank)
        engine, *_ = trident.initialize(model=model, config=_section(layout, bf16), mesh=mesh)
        return _counted(lambda: engine.train_batch(iter([(x, y), (x, y)])))
    mesh = cached_mesh(tp=2) if layout == "tp2" else cached_mesh()
    model = GPT(_config(d_model), mesh) if layout == "tp2" else GPT(_config(d_model))
    engine, *_ = trident.initialize(model=model, config=_section(layout, bf16), mesh=mesh)

    def step():
        engine.backward(engine(x, y))
        engine.step()
    return _counted(step)


def measure(layout: str, bf16: bool) -> dict:
    small, large = _trident(layout, 64, bf16), _trident(layout, 512, bf16)
    plain = _plain(64, micro_batches=2 if layout == "pp2" else 1, mesh=cached_mesh(tp=2) if layout == "tp2" else None)
    return {"small": small.ops, "large": large.ops, "plain": plain.ops, "syncs": max(small.host_syncs, large.host_syncs),
            "summary": large.summary()}


LAYOUTS = ["stage0", "zero1", "zero2", "zero3", "offload", "tp2", "pp2"]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_step_host_work_is_counted_and_bounded(layout, bf16):
    for rank, r in enumerate(run_on_ranks(2, measure, layout, bf16)):
        where = f"{layout} {'bf16' if bf16 else 'fp32'} rank {rank}: {r['summary']}"
        assert r["large"] <= MAX_GROWTH * r["small"], f"{where}: {r['small']} -> {r['large']} operators at 64x the elements"
        assert r["small"] <= MAX_OVER_PLAIN * r["plain"], f"{where}: {r['small']} operators, plain loop {r['plain']}"
        assert r["syncs"] <= MAX_SYNCS, f"{where}: {r['syncs']} host syncs"


def test_step_cost_sees_operators_and_host_reads():
    t = torch.arange(6.0)
    with StepCost() as cost:
        u = (t * 2).sum()
        u.item()
        t.tolist()
        t.view(2, 3)
    assert cost.by_name["aten::mul"] == 1 and cost.by_name["aten::sum"] == 1
    assert cost.host_syncs == 2                      # item() and tolist()
    assert cost.launches == cost.ops - 1             # the view launches no kernel
