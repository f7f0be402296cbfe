"""Context parallelism trains the reference GPT at sequence length 512 to the same losses and
weights as one process (fp32, rtol 1e-5): ring and Ulysses at cp = 2 and 4, composed with
data parallelism and ZeRO-2, with tensor and sequence parallelism, with activation
checkpointing, on packed sequences, and across a checkpoint saved at one cp size and loaded
at another. SGD runs clip on every step, so a wrong loss average over the cp ranks (a factor
of C in the gradient) changes every update.
"""

from __future__ import annotations

import functools

import pytest
import torch

import trident
from trident.models.gpt import GPT, GPTConfig
from trident.tensor_parallel import merge_state_dicts, shard_specs
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.parity import (SerialRun, assert_losses_close, assert_norms_close, assert_state_close,
                                    optimizer_section, train_serial)
from tests.parity.test_dp_equivalence import train_range

STEPS = 5
SEQ = 512
MODEL = dict(vocab_size=61, seq_len=SEQ, n_layer=2, n_head=4, d_model=32, dropout=0.0, bias=False)
OPT_LR = {"adamw": 3e-3, "sgd": 0.5}
# A few entries of blocks.1.mlp.proj's gradient are near 1e-9 on this model: with Adam's default
# eps their rounding noise (a different summation order, as plain dp = 2 has too) becomes steps
# of lr / 2 and the weights differ by 5e-5. eps 1e-6 keeps those entries' steps proportional.
ADAM_EPS = 1e-6
SGD_CLIP = 0.05


def make_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**MODEL))


def make_tokens(global_batch: int, steps: int = STEPS) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, MODEL["vocab_size"], (steps * global_batch, SEQ + 1), generator=g)


def packing(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and document ids of rows packed with documents of 100, 300 and 112 tokens
    (boundaries inside chunks and across cp ranks)."""
    lengths = [100, 300, SEQ - 400]
    positions = torch.cat([torch.arange(n) for n in lengths])
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    return positions.expand(rows, SEQ), docs.expand(rows, SEQ)


def packed_targets(targets: torch.Tensor) -> torch.Tensor:
    """The last token of each document predicts nothing of the next document."""
    targets = targets.clone()
    targets[:, [99, 399]] = -100
    return targets


class Packed(torch.nn.Module):
    """The GPT fed packed rows: positions restart and attention stops at document boundaries."""

    def __init__(self, model: GPT):
        super().__init__()
        self.model = model

    def parallelize_context(self, cp) -> None:
        self.model.parallelize_context(cp)

    def forward(self, idx, targets):
        positions, docs = packing(idx.shape[0])
        return self.model(idx, packed_targets(targets), position_ids=positions, doc_ids=docs)


@functools.lru_cache(maxsize=None)
def serial_reference(global_batch: int, optimizer: str, clip: float, packed: bool = False,
                     steps: int = STEPS) -> SerialRun:
    data = make_tokens(global_batch, steps)
    batches = [(b[:, :-1], b[:, 1:]) for b in data.split(global_batch)]
    model = Packed(make_model()) if packed else make_model()
    run = train_serial(model, batches, optimizer, OPT_LR[optimizer], clip, eps=ADAM_EPS)
    if packed:
        run.weights = {k.removeprefix("model."): v for k, v in run.weights.items()}
    return run


def config(cp: int, method: str, optimizer: str, clip: float, micro: int = 2, stage: int = 0, tp: int = 1,
           checkpointing: bool = False, ulysses_size: int | None = None) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": micro, "steps_per_print": 0, "gradient_clipping": clip,
           "optimizer": optimizer_section(optimizer, OPT_LR[optimizer], eps=ADAM_EPS),
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 4000},
           "context_parallel": {"size": cp, "method": method, "ulysses_size": ulysses_size},
           "tensor_parallel": {"size": tp, "sequence_parallel": tp > 1}}
    if checkpointing:
        cfg["activation_checkpointing"] = {"layers": [r"blocks\.\d+"]}
    return cfg


def train_cp(cp: int, method: str, optimizer: str, clip: float, stage: int = 0, tp: int = 1,
             checkpointing: bool = False, packed: bool = False, ulysses_size: int | None = None):
    mesh = cached_mesh(cp=cp, tp=tp)
    micro = 2
    model = Packed(make_model()) if packed else make_model()
    engine, *_ = trident.initialize(model=model, config=config(cp, method, optimizer, clip, micro, stage, tp,
                                                               checkpointing, ulysses_size), mesh=mesh)
    global_batch = micro * mesh.dp_size
    losses, norms = train_range(engine, mesh, make_tokens(global_batch), 0, STEPS, micro, global_batch)
    weights = {k.removeprefix("model."): v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    return losses, weights, norms, shard_specs(engine.module), mesh.dp_rank, mesh.tp_rank


def check(results, ref: SerialRun, sgd: bool) -> None:
    by_dp: dict[int, dict[int, tuple]] = {}
    for losses, weights, norms, specs, dp_rank, tp_rank in results:
        by_dp.setdefault(dp_rank, {})[tp_rank] = (losses, weights, specs)
        if sgd:
            assert max(ref.clip_coefs) < 1.0, f"clipping inactive on some step: {ref.clip_coefs}"
            assert_norms_close(norms, ref.norms, rtol=1e-6)
    per_dp = [by_dp[d][0][0] for d in sorted(by_dp)]
    assert_losses_close([sum(s) / len(s) for s in zip(*per_dp)], ref.losses, rtol=1e-5)
    for per_tp in by_dp.values():
        shards = [per_tp[t][1] for t in sorted(per_tp)]
        merged = merge_state_dicts(shards, per_tp[0][2]) if len(shards) > 1 else shards[0]
        assert_state_close(merged, ref.weights, rtol=1e-5)


@pytest.mark.parametrize("cp,method,optimizer", [
    (2, "ring", "adamw"),
    (2, "ring", "sgd"),
    (2, "ulysses", "sgd"),
    (4, "ring", "sgd"),
    (4, "ulysses", "adamw"),
])
def test_cp_matches_serial(cp, method, optimizer):
    clip = SGD_CLIP if optimizer == "sgd" else 0.0
    ref = serial_reference(2, optimizer, clip)
    check(run_on_ranks(cp, train_cp, cp, method, optimizer, clip), ref, optimizer == "sgd")


def test_hybrid_cp4_matches_serial():
    ref = serial_reference(2, "sgd", SGD_CLIP)
    check(run_on_ranks(4, train_cp, 4, "hybrid", "sgd", SGD_CLIP, ulysses_size=2), ref, True)


def test_dp2_cp2_zero2_matches_serial():
    ref = serial_reference(4, "sgd", SGD_CLIP)
    check(run_on_ranks(4, train_cp, 2, "ring", "sgd", SGD_CLIP, 2), ref, True)


def test_tp2_cp2_sequence_parallel_matches_serial():
    ref = serial_reference(2, "sgd", SGD_CLIP)
    check(run_on_ranks(4, train_cp, 2, "ring", "sgd", SGD_CLIP, 0, 2), ref, True)


def test_cp2_with_activation_checkpointing_matches_serial():
    ref = serial_reference(2, "sgd", SGD_CLIP)
    check(run_on_ranks(2, train_cp, 2, "ring", "sgd", SGD_CLIP, 0, 1, True), ref, True)


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_packed_sequences_under_cp_match_serial(method):
    ref = serial_reference(2, "sgd", SGD_CLIP, packed=True)
    check(run_on_ranks(2, train_cp, 2, method, "sgd", SGD_CLIP, 0, 1, False, True), ref, True)


def train_pp_cp(schedule: str, micro_batches: int = 2):
    """pp = 2 x cp = 2: the pipelined GPT, every stage's sequences split over its cp pair."""
    from trident.models.gpt_pipe import gpt_pipe, gpt_state_dict, load_gpt_state_dict
    from tests.parity.test_pp_equivalence import pipe_steps
    mesh = cached_mesh(pp=2, cp=2)
    cfg = GPTConfig(**MODEL)
    pipe = gpt_pipe(cfg, 2, partition_method="uniform", stage_id=mesh.pp_rank)
    load_gpt_state_dict(pipe, make_model().state_dict(), cfg)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": micro_batches,
              "optimizer": optimizer_section("sgd", OPT_LR["sgd"]), "gradient_clipping": SGD_CLIP,
              "steps_per_print": 0, "pipeline": {"stages": 2, "schedule": schedule},
              "context_parallel": {"size": 2}}
    engine, *_ = trident.initialize(model=pipe, config=config, mesh=mesh)
    losses, norms = pipe_steps(engine, mesh, make_tokens(micro_batches), STEPS, 1, micro_batches)
    return losses, gpt_state_dict(pipe, cfg), norms


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pp2_cp2_matches_serial(schedule):
    ref = serial_reference(2, "sgd", SGD_CLIP)
    results = run_on_ranks(4, train_pp_cp, schedule)
    merged = {}
    for losses, weights, norms in results:
        assert_losses_close(losses, ref.losses, rtol=1e-5)
        assert_norms_close(norms, ref.norms, rtol=1e-6)
        merged.update(weights)
    assert_state_close(merged, ref.weights, rtol=1e-5)


def train_and_save_or_resume(cp: int, first: int, last: int, path: str, save: bool):
    """Steps first..last-1 of a ZeRO-2 run at this cp size (dp takes the rest of the world),
    from the checkpoint in `path` when first > 0; saves one there at the end when `save`."""
    mesh = cached_mesh(cp=cp)
    micro, global_batch = 4 // mesh.dp_size, 4
    engine, *_ = trident.initialize(model=make_model(), config=config(cp, "ring", "sgd", SGD_CLIP, micro, 2),
                                    mesh=mesh)
    if first:
        engine.load_checkpoint(path)
        assert engine.global_steps == first
    losses, norms = train_range(engine, mesh, make_tokens(global_batch), first, last, micro, global_batch)
    if save:
        engine.save_checkpoint(path)
    return losses, {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}, norms


@pytest.mark.parametrize("world_after,cp_after", [(2, 1), (4, 4)])
def test_checkpoint_at_cp2_resumes_at_another_cp_size(tmp_path, world_after, cp_after):
    """cp holds no state of its own: a dp2 x cp2 ZeRO-2 checkpoint continues at cp 1 (dp 2) and
    at cp 4 (dp 1) with the losses of one uninterrupted process."""
    ref = serial_reference(4, "sgd", SGD_CLIP)
    before = run_on_ranks(4, train_and_save_or_resume, 2, 0, 3, str(tmp_path), True)
    after = run_on_ranks(world_after, train_and_save_or_resume, cp_after, 3, STEPS, str(tmp_path), False)
    def mean(results):  # every cp rank reports its replica's loss; the batch's is the mean over dp
        return [sum(step) / len(step) for step in zip(*(r[0] for r in results))]
    assert_losses_close(mean(before) + mean(after), ref.losses, rtol=1e-5)
    for losses, weights, norms in after:
        assert_norms_close(before[0][2] + norms, ref.norms, rtol=1e-6)
        assert_state_close(weights, ref.weights, rtol=1e-5)


class UserAttention(torch.nn.Module):
    """A user's own model, written once for both cases: it opts in to context parallelism with
    `context_parallel_aware` and the documented calls (shard_batch, positions, attention with
    grouped-query heads, global_mean); without cp the same code is plain attention."""

    context_parallel_aware = True

    def __init__(self, vocab: int = 61, d: int = 32, heads: int = 4, kv_heads: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.tok, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(SEQ, d)
        self.q = torch.nn.Linear(d, d, bias=False)
        self.kv = torch.nn.Linear(d, 2 * kv_heads * self.hd, bias=False)
        self.out = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets):
        from trident import context_parallel
        cp = context_parallel.current()
        positions = torch.arange(idx.shape[1])
        if cp is not None:
            idx, targets = context_parallel.shard_batch(idx, targets)
            positions = cp.positions(positions.shape[0])
        x = self.tok(idx) + self.pos(positions)
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, self.kv_heads, self.hd).permute(2, 0, 3, 1, 4).unbind(0)
        y = context_parallel.attention(q, k, v, causal=True).transpose(1, 2).reshape(b, t, -1)
        total = torch.nn.functional.cross_entropy(self.out(x + y).flatten(0, 1), targets.flatten(), reduction="sum")
        count = targets.numel()
        return cp.global_mean(total, count) if cp is not None else total / count


def train_user_model(cp: int, method: str):
    mesh = cached_mesh(cp=cp)
    cfg = config(cp, method, "sgd", SGD_CLIP)
    engine, *_ = trident.initialize(model=UserAttention(), config=cfg, mesh=mesh)
    losses, norms = train_range(engine, mesh, make_tokens(2), 0, STEPS, 2, 2)
    return losses, {k: v.detach().clone() for k, v in engine.module.state_dict().items()}, norms


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_user_attention_opts_in(method):
    data = make_tokens(2)
    ref = train_serial(UserAttention(), [(b[:, :-1], b[:, 1:]) for b in data.split(2)], "sgd", OPT_LR["sgd"],
                       SGD_CLIP)
    for losses, weights, norms in run_on_ranks(2, train_user_model, 2, method):
        assert_losses_close(losses, ref.losses, rtol=1e-5)
        assert_norms_close(norms, ref.norms, rtol=1e-6)
        assert_state_close(weights, ref.weights, rtol=1e-5)


def _bad_inputs():
    mesh = cached_mesh(cp=2)
    base = {"train_micro_batch_size_per_gpu": 1, "optimizer": optimizer_section("sgd", 0.1)}
    errors = []
    for model, section in [(torch.nn.Linear(4, 4), {"size": 2}),
                           (make_model(), {"size": 2, "method": "ulysses"})]:
        if isinstance(model, GPT):
            model.config.n_head = 3  # heads the Ulysses split cannot share out
        try:
            trident.initialize(model=model, config={**base, "context_parallel": section}, mesh=mesh)
        except ValueError as err:
            errors.append(str(err))
    engine, *_ = trident.initialize(model=make_model(), config={**base, "context_parallel": {"size": 2}}, mesh=mesh)
    try:
        engine(torch.zeros(1, 6, dtype=torch.long), torch.zeros(1, 6, dtype=torch.long))
    except ValueError as err:
        errors.append(str(err))
    return errors


def test_bad_inputs_get_one_clear_error_each():
    for errors in run_on_ranks(2, _bad_inputs):
        assert len(errors) == 3, errors
        assert "Linear has no context-parallel attention" in errors[0]
        assert "3 attention heads per tensor-parallel rank are not divisible by the Ulysses size 2" in errors[1]
        assert "6 tokens, not divisible by 2 x context_parallel.size = 4" in errors[2]


def train_llama_cp(cp: int, method: str):
    """An unmodified transformers LlamaForCausalLM (grouped-query attention) under cp."""
    from tests.parity.test_pp_hf import make as make_lm
    from tests.distributed.test_lora_export import CausalLMLoss
    mesh = cached_mesh(cp=cp)
    engine, *_ = trident.initialize(model=CausalLMLoss(make_lm("llama")), config=config(cp, method, "sgd", SGD_CLIP),
                                    mesh=mesh)
    data = llama_tokens()
    losses, norms = [], []
    for batch in data.split(2):
        engine.backward(engine(batch))
        engine.step()
        losses.append(engine.last_loss)
        norms.append(engine.get_global_grad_norm())
    assert engine.module.lm.config._attn_implementation == "trident_context_parallel"
    assert method != "ring" or engine.module.context_parallel.stats["block_pairs"] > 0  # the ring ran
    return losses, {k: v.detach().clone() for k, v in engine.module.state_dict().items()}, norms


def llama_tokens() -> torch.Tensor:
    from tests.parity.test_pp_hf import SEQ, VOCAB
    return torch.randint(0, VOCAB, (STEPS * 2, SEQ), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_transformers_llama_under_cp2_matches_serial(method):
    from tests.parity.test_pp_hf import make as make_lm
    from tests.distributed.test_lora_export import CausalLMLoss
    ref = train_serial(CausalLMLoss(make_lm("llama")), [(b,) for b in llama_tokens().split(2)], "sgd", OPT_LR["sgd"],
                       SGD_CLIP)
    for losses, weights, norms in run_on_ranks(2, train_llama_cp, 2, method):
        assert_losses_close(losses, ref.losses, rtol=1e-5)
        assert_norms_close(norms, ref.norms, rtol=1e-6)
        assert_state_close(weights, ref.weights, rtol=1e-5)
