"""`initialize(model_parameters=...)` in every form DeepSpeed takes, mapped onto the parameters
the engine trains after the tensor-parallel plan replaced them by shards (issue 32, item 1).

A transformers GPT-2 and LLaMA split by `tensor_parallel: {size: 2, plan: "auto"}` from the config,
with `model_parameters` as a generator, as a list and as two param groups with different weight
decay (decay / no decay, as Hugging Face and Megatron scripts build them): each trains like one
process running torch's AdamW over the same groups.
"""

from __future__ import annotations

import math

import pytest
import torch

import trident
from tests.distributed.test_lora_export import CausalLMLoss
from tests.parity.test_pp_hf import SEQ, VOCAB
from tests.parity.test_pp_hf import make as make_lm
from trident.testing.distributed import cached_mesh, run_on_ranks

STEPS, BATCH, LR, CLIP = 4, 4, 1e-2, 1.0
DECAY, NO_DECAY = 0.1, 0.0


def tokens() -> torch.Tensor:
    """One batch, every step: the loss falls fast (a stale optimizer would barely move it)."""
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3)).repeat(STEPS, 1)


def model_parameters(model: torch.nn.Module, form: str):
    if form == "generator":
        return model.parameters()
    if form == "list":
        return list(model.parameters())
    named = list(model.named_parameters())
    decay = [p for n, p in named if p.ndim >= 2]
    no_decay = [p for n, p in named if p.ndim < 2]  # biases and norm weights, as HF's Trainer groups them
    return [{"params": decay, "weight_decay": DECAY}, {"params": no_decay, "weight_decay": NO_DECAY}]


def serial(kind: str, form: str) -> list[float]:
    model = CausalLMLoss(make_lm(kind))
    groups = model_parameters(model, form)
    opt = torch.optim.AdamW(groups, lr=LR, weight_decay=DECAY)
    losses = []
    for batch in tokens().split(BATCH):
        loss = model(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, error_if_nonfinite=True)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train_tp(kind: str, form: str, where: str):
    mesh = cached_mesh(tp=2)
    model = CausalLMLoss(make_lm(kind))
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "steps_per_print": 0, "gradient_clipping": CLIP,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": DECAY}},
           "tensor_parallel": {"size": 2, "plan": "auto"}}
    if where == "optimizer":  # a client optimizer over the groups, built before initialize
        engine, *_ = trident.initialize(model=model, config={k: v for k, v in cfg.items() if k != "optimizer"},
                                        optimizer=torch.optim.AdamW(model_parameters(model, form), lr=LR,
                                                                    weight_decay=DECAY), mesh=mesh)
    else:
        engine, *_ = trident.initialize(model=model, config=cfg, model_parameters=model_parameters(model, form),
                                        mesh=mesh)
    trained = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    losses = []
    for batch in tokens().split(BATCH):
        engine.backward(engine(batch))
        engine.step()
        losses.append(engine.last_loss)
    decays = sorted({g["weight_decay"] for g in engine.optimizer.param_groups})
    return losses, len(engine.optimizer.param_groups), decays, len(trained)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("form", ["generator", "list", "groups"])
def test_hf_model_under_tp2_trains_like_one_process_for_every_form(kind, form):
    ref = serial(kind, form)
    assert ref[-1] < ref[0] - 0.2, ref  # the loss moves: a stale optimizer would barely change it
    results = run_on_ranks(2, train_tp, kind, form, "model_parameters")
    for losses, groups, decays, _ in results:
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref)) < 1e-5, (losses, ref)
        assert (groups, decays) == ((2, [NO_DECAY, DECAY]) if form == "groups" else (1, [DECAY]))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_client_optimizer_groups_follow_the_tp_plan(kind):
    ref = serial(kind, "groups")
    for losses, groups, decays, _ in run_on_ranks(2, train_tp, kind, "groups", "optimizer"):
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref)) < 1e-5, (losses, ref)
        assert (groups, decays) == (2, [NO_DECAY, DECAY])


def train_other_layouts(kind: str, form: str, layout: str):
    """The groups under a pipeline split of the unmodified model (pp 2) or ZeRO-3 over dp 2."""
    mesh = cached_mesh(pp=2) if layout == "pp2" else cached_mesh()
    model = CausalLMLoss(make_lm(kind)) if layout == "zero3" else make_lm(kind)
    per_rank = BATCH // mesh.dp_size
    cfg = {"train_micro_batch_size_per_gpu": per_rank // 2 if layout == "pp2" else per_rank, "steps_per_print": 0,
           "gradient_clipping": CLIP, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": DECAY}},
           "gradient_accumulation_steps": 2 if layout == "pp2" else 1,
           "pipeline": {"stages": 2 if layout == "pp2" else 1},
           "zero_optimization": {"stage": 3 if layout == "zero3" else 0}}
    engine, *_ = trident.initialize(model=model, config=cfg, model_parameters=model_parameters(model, form), mesh=mesh)
    losses = []
    for batch in tokens().split(BATCH):
        if layout == "pp2":
            losses.append(float(engine.train_batch(iter([(b, b) for b in batch.split(BATCH // 2)]))))
        else:
            engine.backward(engine(batch[mesh.dp_rank * per_rank:(mesh.dp_rank + 1) * per_rank]))
            engine.step()
            losses.append(engine.last_loss)
    return losses, sorted({g["weight_decay"] for g in engine.optimizer.param_groups})


@pytest.mark.parametrize("layout", ["pp2", "zero3"])
def test_groups_follow_a_pipeline_split_and_zero3(layout):
    ref = serial("llama", "groups")
    results = run_on_ranks(2, train_other_layouts, "llama", "groups", layout)
    dp_mean = [sum(s) / len(s) for s in zip(*(r[0] for r in results))]  # zero3: each rank its half's loss
    losses = results[-1][0] if layout == "pp2" else dp_mean
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref)) < 1e-5, (losses, ref)
    assert all(r[1] == [NO_DECAY, DECAY] for r in results)


def lora_groups(form: str):
    """One process, LoRA from the config: the frozen base drops out, each adapter joins the group
    of the weight it adapts."""
    mesh = cached_mesh(tp=1)
    model = CausalLMLoss(make_lm("llama"))
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": LR}},
           "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}}
    engine, *_ = trident.initialize(model=model, config=cfg, model_parameters=model_parameters(model, form), mesh=mesh)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    return [sorted(names[id(p)] for p in g["params"]) for g in engine.optimizer.param_groups] \
        if engine.master is None else [len(g["params"]) for g in engine.optimizer.param_groups]


def test_lora_adapters_join_the_group_of_the_weight_they_adapt():
    [sizes] = run_on_ranks(1, lora_groups, "groups")
    assert sizes[0] > 0 and sizes[1] == 0  # 2-D weights decay: the adapters of q/v (2-D) are there


def bad_parameters(what: str):
    mesh = cached_mesh(tp=1)
    model = CausalLMLoss(make_lm("gpt2"))
    given = {"stranger": [torch.nn.Parameter(torch.zeros(3))], "empty": [],
             "mixed": [next(model.parameters()), {"params": []}], "no params key": [{"lr": 1.0}]}[what]
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": LR}}}
    try:
        trident.initialize(model=model, config=cfg, model_parameters=given, mesh=mesh)
    except (ValueError, TypeError) as err:
        return str(err)
    return None


@pytest.mark.parametrize("what,message", [
    ("stranger", "model_parameters holds a tensor of shape (3,) that is not a parameter of the model"),
    ("empty", "initialize(model_parameters=...) is empty"),
    ("mixed", "model_parameters mixes param-group dicts and parameters"),
    ("no params key", "model_parameters[0] has no 'params' entry"),
])
def test_model_parameters_that_cannot_be_mapped_are_errors(what, message):
    [text] = run_on_ranks(1, bad_parameters, what)
    assert text is not None and message in text, text


def test_the_reference_moves():
    assert not math.isnan(serial("gpt2", "list")[0])


def left_out(form: str):
    """A parameter the user leaves out of model_parameters stays out, after the tp plan too; LoRA's
    adapters, which did not exist when the user listed, join their layer's group."""
    mesh = cached_mesh(tp=2)
    model = CausalLMLoss(make_lm("gpt2"))
    given = [p for n, p in model.named_parameters() if not n.endswith(".bias")]
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0, "tensor_parallel": {"size": 2, "plan": "auto"},
           "optimizer": {"type": "AdamW", "params": {"lr": LR}}}
    engine, *_ = trident.initialize(model=model, config=cfg, model_parameters=given, mesh=mesh)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    masters = engine.master.mapping() if engine.master is not None else {}
    by_master = {id(m): names[i] for i, m in masters.items()} if masters else names
    trained = [by_master.get(id(p), "?") for g in engine.optimizer.param_groups for p in g["params"]]
    return sorted(trained), sorted(n for n in names.values() if n.endswith(".bias"))


def test_a_parameter_left_out_stays_out():
    for trained, biases in run_on_ranks(2, left_out, "list"):
        assert biases and not any(n.endswith(".bias") for n in trained) and "?" not in trained, trained
