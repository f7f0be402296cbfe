"""DeepSpeed's seqlen curriculum under data parallelism trains as one process: 2 ranks of 2 rows
each against 1 rank of the same 4 rows, every step cut to the schedule's length by the engine,
clipped SGD with momentum (the clip active: a wrong averaging factor would show), fp32."""
from __future__ import annotations

import torch

import trident
from trident.models.gpt import GPT, GPTConfig
from trident.testing.distributed import cached_mesh, run_on_ranks

SEQ, VOCAB, STEPS = 32, 61, 6
CURRICULUM = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8, "max_difficulty": SEQ,
              "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": STEPS, "difficulty_step": 8}}
CLIP = 0.05


def rows(step: int) -> torch.Tensor:
    """The global batch of a step: 4 rows of SEQ + 1 tokens."""
    return torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(step))


def train(world: int) -> dict:
    mesh = cached_mesh()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=1, n_head=2, d_model=16))
    seen: list[int] = []
    model.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[1]))
    config = {"train_micro_batch_size_per_gpu": 4 // world, "gradient_accumulation_steps": 1,
              "gradient_clipping": CLIP, "curriculum_learning": CURRICULUM,
              "optimizer": {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}}}
    engine, *_ = trident.initialize(model=model, config=config, mesh=mesh)
    losses, norms = [], []
    share = 4 // world
    for step in range(STEPS):
        batch = rows(step)[mesh.dp_rank * share:(mesh.dp_rank + 1) * share]
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))
        engine.step()
        losses.append(engine.last_loss)
        norms.append(engine.get_global_grad_norm())
    weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return {"losses": losses, "norms": norms, "weights": weights, "seen": seen}


def test_curriculum_on_two_ranks_matches_one_process():
    (one,) = run_on_ranks(1, train, 1)
    two = run_on_ranks(2, train, 2)
    assert one["seen"] == [8, 16, 16, 24, 24, 32]  # the schedule, cut by the engine
    assert all(n > CLIP for n in one["norms"])  # the clip is active on every step
    mean_loss = (torch.tensor(two[0]["losses"]) + torch.tensor(two[1]["losses"])) / 2  # each rank's is its own rows'
    torch.testing.assert_close(mean_loss, torch.tensor(one["losses"]), rtol=1e-5, atol=0)
    for rank in two:
        assert rank["seen"] == one["seen"]
        torch.testing.assert_close(torch.tensor(rank["norms"]), torch.tensor(one["norms"]), rtol=1e-5, atol=0)
        for name, w in one["weights"].items():
            torch.testing.assert_close(rank["weights"][name], w, rtol=1e-5, atol=1e-7, msg=name)
