"""LoRA checkpoints: merged into plain weights offline, and resumed under another layout.

Merging: the reference GPT trains with the config's `lora` section on 2 ranks (ZeRO-3 over dp,
and tp 2 with a padded vocabulary), saves, and `trident checkpoint merge-lora` writes the merged
model. Loaded into a plain `GPT`, it must give the logits of the trained LoRA model: that model
consolidated into one process (the serial reference, checked itself against the live engine's
logits). Resuming: a checkpoint saved under dp2 ZeRO-2 or ZeRO-3 loads under tp2 and under dp2
stage 0 with the same `lora` section and trains on to the losses and weights of an
uninterrupted run under that layout (fp32, rtol 1e-5 as in test_reshard.py).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import trident
from trident.cli.main import main
from trident.models.gpt import GPT, GPTConfig
from trident.peft import apply_lora
from trident.peft.merge import merge_lora_state_dict
from trident.tensor_parallel import merge_state_dicts, shard_specs
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.parity import assert_losses_close, assert_state_close
from tests.parity.test_dp_equivalence import train_range

# Biases on, so the base bias moves back to `<path>.bias`; an odd vocabulary, padded under tp.
MODEL = dict(vocab_size=61, seq_len=16, n_layer=2, n_head=2, d_model=32, dropout=0.0)
LORA = {"r": 4, "alpha": 12.0, "target_modules": ["qkv", "proj", "fc"]}
SEED, MICRO, GLOBAL, SAVE_AT, STEPS = 7, 2, 8, 3, 6
# Logits of the merged and the adapted model differ by fp32 rounding of W + s B A against
# W x + s B (A x): about 1e-7 of their size.
LOGIT_TOL = 1e-5


def make_gpt(mesh=None) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**MODEL), mesh)


def make_tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, MODEL["vocab_size"], (STEPS * GLOBAL, MODEL["seq_len"] + 1), generator=g)


def probe() -> torch.Tensor:
    return torch.randint(0, MODEL["vocab_size"], (3, MODEL["seq_len"]), generator=torch.Generator().manual_seed(2))


def config(dp: int, tp: int, zero: int, lora: dict | None = LORA) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GLOBAL // (MICRO * dp),
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "gradient_clipping": 1.0, "steps_per_print": 0, "seed": SEED,
           "zero_optimization": {"stage": zero, "reduce_bucket_size": 2000, "sub_group_size": 1500,
                                 "stage3_param_persistence_threshold": 0},
           "tensor_parallel": {"size": tp}}
    if lora is not None:
        cfg["lora"] = lora
    return cfg


def run(dp: int, tp: int, zero: int, root: str | None, mode: str, lora: dict | None = LORA):
    """Every rank. mode: 'save' (steps 1..SAVE_AT, save), 'resume' (load, the remaining steps),
    'straight' (every step, the last ones reported). Returns losses, this rank's consolidated
    weights and tp specs, the live model's logits on `probe()`, and (dp rank, tp rank)."""
    mesh = cached_mesh(tp=tp)
    engine, *_ = trident.initialize(model=make_gpt(mesh if tp > 1 else None), config=config(dp, tp, zero, lora),
                                    mesh=mesh)
    if mode == "resume":
        engine.load_checkpoint(root)
        assert engine.global_steps == SAVE_AT
    first, last = {"save": (0, SAVE_AT), "resume": (SAVE_AT, STEPS), "straight": (0, STEPS)}[mode]
    losses, _ = train_range(engine, mesh, make_tokens(), first, last, MICRO, GLOBAL)
    if mode == "save":
        engine.save_checkpoint(root)
    weights = {k: v.float() for k, v in engine.consolidated_state_dict().items()}
    engine.eval()
    with torch.no_grad():
        logits = engine(probe())
    losses = losses[SAVE_AT:] if mode == "straight" else losses
    return losses, weights, shard_specs(engine.module), logits, (mesh.dp_rank, mesh.tp_rank)


def save_hand_applied(root: str) -> None:
    """Every rank: LoRA applied by the user, not by the config; the manifest reads it off the layers."""
    mesh = cached_mesh()
    model = apply_lora(make_gpt(), seed=SEED, **LORA)
    engine, *_ = trident.initialize(model=model, config=config(2, 1, 1, lora=None), mesh=mesh)
    batch = make_tokens()[mesh.dp_rank * MICRO:(mesh.dp_rank + 1) * MICRO]
    for _ in range(GLOBAL // (MICRO * 2)):
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))
        engine.step()
    engine.save_checkpoint(root)


def whole(results) -> dict[str, torch.Tensor]:
    """The whole model's weights: dp rank 0's, tp shards merged."""
    mine = sorted((r for r in results if r[4][0] == 0), key=lambda r: r[4][1])
    return merge_state_dicts([r[1] for r in mine], mine[0][2]) if len(mine) > 1 else mine[0][1]


def mean_losses(results) -> list[float]:
    """The global batch's loss per step: the mean over dp ranks (tp ranks agree)."""
    per_dp = [r[0] for r in results if r[4][1] == 0]
    return [sum(step) / len(step) for step in zip(*per_dp)]


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    diff = (actual - expected).abs().max().item()
    assert diff <= LOGIT_TOL * expected.abs().max().item(), (
        f"{what}: max |logit difference| {diff:.3e} (largest logit {expected.abs().max().item():.3f})")


@pytest.mark.parametrize("dp,tp,zero", [(2, 1, 3), (1, 2, 0)], ids=["dp2-zero3", "tp2"])
def test_merged_checkpoint_gives_the_trained_lora_model_s_logits(dp, tp, zero, tmp_path, capsys):
    root, out = tmp_path / "ckpt", tmp_path / "merged"
    results = run_on_ranks(dp * tp, run, dp, tp, zero, str(root), "save")

    serial = apply_lora(GPT(GPTConfig(**MODEL)), seed=SEED, **LORA)  # the trained LoRA model, one process
    serial.load_state_dict(whole(results))
    serial.eval()
    with torch.no_grad():
        expected = serial(probe())
    for r in results:  # the serial reference is the model the ranks trained
        assert_logits_close(r[3], expected, f"live engine, rank {r[4]}")

    assert main(["checkpoint", "merge-lora", str(root), str(out)]) == 0
    summary = capsys.readouterr().out
    assert f"merged {4 * MODEL['n_layer']} LoRA layers (r=4, alpha=12, scaling 3)" in summary
    merged = load_file(str(out / "model.safetensors"))
    assert not any("lora_" in k or ".base." in k for k in merged)
    plain = GPT(GPTConfig(**MODEL))
    missing, unexpected = plain.load_state_dict(merged, strict=False)
    assert (missing, unexpected) == (["lm_head.weight"], []), (missing, unexpected)  # tied to embed.wte
    plain.eval()
    with torch.no_grad():
        assert_logits_close(plain(probe()), expected, "merged model vs the trained LoRA model")
    delta = (merged["blocks.0.mlp.fc.weight"] - make_gpt().blocks[0].mlp.fc.weight).abs().max().item()
    assert delta > 1e-3, "training moved no adapter: the check above would pass without merging"


@functools.lru_cache(maxsize=None)
def saved_under(zero: int, root: str) -> Path:
    run_on_ranks(2, run, 2, 1, zero, root, "save")
    return Path(root)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp("lora")
    return lambda zero: saved_under(zero, str(base / f"zero{zero}"))


@pytest.fixture(scope="module")
def zero2_checkpoint(checkpoints):
    return checkpoints(2)


@functools.lru_cache(maxsize=None)
def straight(dp: int, tp: int, zero: int):
    return run_on_ranks(dp * tp, run, dp, tp, zero, None, "straight")


@pytest.mark.parametrize("saved_zero", [2, 3], ids=["from-dp2-zero2", "from-dp2-zero3"])
@pytest.mark.parametrize("dp,tp,zero", [(1, 2, 0), (2, 1, 0)], ids=["to-tp2", "to-dp2-stage0"])
def test_lora_checkpoint_resumes_under_another_layout(checkpoints, saved_zero, dp, tp, zero):
    resumed = run_on_ranks(dp * tp, run, dp, tp, zero, str(checkpoints(saved_zero)), "resume")
    assert_losses_close(mean_losses(resumed), mean_losses(straight(dp, tp, zero)), rtol=1e-5)
    assert_state_close(whole(resumed), whole(straight(dp, tp, zero)), rtol=1e-5)


def test_merge_lora_names_what_is_missing(zero2_checkpoint, tmp_path, capsys):
    folder = zero2_checkpoint / f"global_step{SAVE_AT}"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["lora"] == {"r": 4, "alpha": 12.0}
    del manifest["lora"]  # as an older trident saved it
    (folder / "manifest.json").write_text(json.dumps(manifest))
    try:
        assert main(["checkpoint", "merge-lora", str(zero2_checkpoint), str(tmp_path / "a")]) == 1
        assert "records no `lora` entry" in capsys.readouterr().err
        assert main(["checkpoint", "merge-lora", str(zero2_checkpoint), str(tmp_path / "b"), "--scaling", "3"]) == 0
    finally:
        manifest["lora"] = {"r": 4, "alpha": 12.0}
        (folder / "manifest.json").write_text(json.dumps(manifest))

    by_hand = tmp_path / "by_hand"
    run_on_ranks(2, save_hand_applied, str(by_hand))
    assert json.loads((by_hand / "global_step1" / "manifest.json").read_text())["lora"] == {"r": 4, "alpha": 12.0}
    assert main(["checkpoint", "merge-lora", str(by_hand), str(tmp_path / "d")]) == 0
    assert "(r=4, alpha=12, scaling 3)" in capsys.readouterr().out

    plain_root = tmp_path / "plain"
    run_on_ranks(2, run, 2, 1, 0, str(plain_root), "save", None)
    assert main(["checkpoint", "merge-lora", str(plain_root), str(tmp_path / "c")]) == 1
    assert "no LoRA adapters in this checkpoint" in capsys.readouterr().err
    with pytest.raises(ValueError, match="has blocks.0.attn.qkv.lora_A but no blocks.0.attn.qkv.lora_B"):
        merge_lora_state_dict({"blocks.0.attn.qkv.lora_A": torch.zeros(1, 1),
                               "blocks.0.attn.qkv.base.weight": torch.zeros(1, 1)}, 1.0)
