"""Two tied keys over three pipeline stages train like one process (fp32, rtol 1e-5).

    stage 0: embed (owner), block1, block2       stage 1: shared (owner), block4, block5
    stage 2: shared (copy), block7, embed^T (copy: the output projection reuses the embedding)

Each key gets its own group of the stages holding it ([0, 2] and [1, 2]), from the mesh. A
rank on stage 2 holds both keys, so its copies' gradients go to two owners and two broadcasts
refresh it after each step. (This layout used to hang while the groups were built.) SGD with
momentum and gradient clipping active on every step: a tied gradient counted twice or missed
changes the norm and so every update. Every layer draws its weights from its own seed, so the
pipelined stages and the serial model start equal without copying weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import trident
from trident.engine.pipeline_engine import PipelineEngine
from trident.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.parity import (assert_losses_close, assert_norms_close, assert_state_close, optimizer_section,
                                    train_serial)

VOCAB, WIDTH, SEQ = 13, 8, 6
STEPS, MICRO, MICRO_BATCHES = 8, 2, 4
LR, CLIP = 0.2, 0.3  # CLIP below the gradient norm on every step (checked)
STAGES = 3
EMBED_SEED, SHARED_SEED = 100, 200
UNTIED = (1, 2, 4, 5, 7)  # layer indices of the untied blocks: the serial model's block{i}, seed i


def _weight(seed: int, *shape: int, scale: float) -> nn.Parameter:
    g = torch.Generator().manual_seed(seed)
    return nn.Parameter(torch.randn(*shape, generator=g, device="cpu") * scale)  # cpu even under meta counting


class Embed(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.weight = _weight(seed, VOCAB, WIDTH, scale=0.5)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, self.weight)


class Block(nn.Module):
    """x + proj(tanh(fc x + bias))"""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.fc = _weight(seed, WIDTH, WIDTH, scale=WIDTH ** -0.5)
        self.bias = _weight(seed + 1000, WIDTH, scale=0.1)
        self.proj = _weight(seed + 2000, WIDTH, WIDTH, scale=WIDTH ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(x @ self.fc.t() + self.bias) @ self.proj.t()


def logits(embed: Embed, h: torch.Tensor) -> torch.Tensor:
    return h @ embed.weight.t()


def loss_fn(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), labels.flatten())


class Serial(nn.Module):
    """The same model in one process: embed, block1, block2, shared, block4, block5, shared
    again, block7, embed^T."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.shared = Embed(EMBED_SEED), Block(SHARED_SEED)
        for i in UNTIED:
            self.add_module(f"block{i}", Block(i))

    def forward(self, idx: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for layer in (self.block1, self.block2, self.shared, self.block4, self.block5, self.shared, self.block7):
            h = layer(h)
        return loss_fn(logits(self.embed, h), labels)


def pipeline_module(stage_id: int) -> PipelineModule:
    """Nine layers, three per stage (uniform partition)."""
    shared = TiedLayerSpec("shared", Block, SHARED_SEED)
    layers = [TiedLayerSpec("embed", Embed, EMBED_SEED), LayerSpec(Block, 1), LayerSpec(Block, 2),
              shared, LayerSpec(Block, 4), LayerSpec(Block, 5),
              shared, LayerSpec(Block, 7), TiedLayerSpec("embed", Embed, EMBED_SEED, forward_fn=logits)]
    return PipelineModule(layers, STAGES, loss_fn=loss_fn, partition_method="uniform", stage_id=stage_id)


def tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, VOCAB, (STEPS * MICRO * MICRO_BATCHES, SEQ + 1), generator=g)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(b[:, :-1], b[:, 1:]) for b in tokens().split(MICRO * MICRO_BATCHES)]


def stage_weights(pipe: PipelineModule) -> dict[str, torch.Tensor]:
    """This stage's weights (tied copies included) under the serial model's names."""
    out = {}
    for name, t in pipe.state_dict().items():
        head, _, rest = name.partition(".")
        serial = rest if head == "tied_modules" else f"block{head}.{rest}"
        out[serial] = t.detach().clone()
    return out


def train_pipelined(schedule: str) -> dict:
    mesh = cached_mesh(pp=STAGES)
    pipe = pipeline_module(mesh.pp_rank)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": MICRO_BATCHES,
        "optimizer": optimizer_section("sgd", LR),
        "gradient_clipping": CLIP,
        "pipeline": {"stages": STAGES, "schedule": schedule, "partition_method": "uniform"},
        "steps_per_print": 0,
    }
    engine, *_ = trident.initialize(model=pipe, config=config, mesh=mesh)
    assert isinstance(engine, PipelineEngine)
    ties = {t.key: (dist.get_process_group_ranks(t.group), t.owner,
                    mesh.subgroup("pp", pipe.tied_stages[t.key], tag=f"tied:{t.key}") is t.group)  # cached
            for t in engine.ties}
    losses, norms = [], []
    for x, y in batches():
        micro = list(zip(x.split(MICRO), y.split(MICRO)))
        losses.append(float(engine.train_batch(iter(micro))))
        norms.append(engine.get_global_grad_norm())
    return {"losses": losses, "norms": norms, "weights": stage_weights(pipe), "ties": ties}


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_two_tied_keys_over_three_stages_match_serial(schedule):
    torch.manual_seed(0)
    ref = train_serial(Serial(), batches(), "sgd", LR, CLIP)
    assert max(ref.clip_coefs) < 1.0, f"clipping inactive on some step: {ref.clip_coefs}"
    results = run_on_ranks(STAGES, train_pipelined, schedule)
    expected_ties = [{"embed": ([0, 2], True, True)}, {"shared": ([1, 2], True, True)},
                     {"embed": ([0, 2], False, True), "shared": ([1, 2], False, True)}]
    covered = set()
    for stage, got in enumerate(results):
        assert got["ties"] == expected_ties[stage]
        assert_losses_close(got["losses"], ref.losses, rtol=1e-5)
        assert_norms_close(got["norms"], ref.norms, rtol=1e-6)
        # copies too: the owner's broadcast after the last step left them equal to the serial weights
        assert_state_close(got["weights"], {k: ref.weights[k] for k in got["weights"]}, rtol=1e-5)
        covered |= got["weights"].keys()
    assert covered == set(ref.weights)


def _initialize_tied_copy_only_stage() -> str:
    """Stage 1 holds only the output projection, a copy of stage 0's embedding: no parameter."""
    mesh = cached_mesh(pp=2)
    layers = [TiedLayerSpec("embed", Embed, EMBED_SEED), LayerSpec(Block, 1),
              TiedLayerSpec("embed", Embed, EMBED_SEED, forward_fn=logits)]
    pipe = PipelineModule(layers, 2, loss_fn=loss_fn, partition_method="uniform", stage_id=mesh.pp_rank)
    config = {"train_micro_batch_size_per_gpu": MICRO, "optimizer": optimizer_section("sgd", LR),
              "pipeline": {"stages": 2, "partition_method": "uniform"}, "steps_per_print": 0}
    with pytest.raises(ValueError) as err:
        trident.initialize(model=pipe, config=config, mesh=mesh)
    return str(err.value)


def test_a_stage_holding_only_tied_copies_is_refused_with_the_reason():
    messages = run_on_ranks(2, _initialize_tied_copy_only_stage)
    assert messages[0] == messages[1]  # both stages stop with the same error, neither waits
    assert "pipeline stage(s) [1] of 2 hold no trainable parameter" in messages[0]
    assert "copies of tied weights" in messages[0] and "partition" in messages[0]
