"""`TridentTrainer` (a `transformers.Trainer` on trident's engine) on 2 gloo ranks against
`transformers.Trainer` in one process, same `TrainingArguments`: the same losses, and resuming
from the checkpoint it wrote at step 5 continues identically.

ZeRO-2 on dp=2 (per-device batch 2 x 2 ranks = the single process's batch of 4) with the
config's AdamW section "auto"-filled from the arguments; tp=2 by the model's own plan ("hf")
with the Trainer's own optimizer (TrainingArguments.optim="sgd"); ZeRO-3 with batch 1 x
accumulation 2 x 2 ranks. A tiny LlamaForCausalLM (GQA) built from a config, fp32, 24 in-memory
samples (two epochs in 10 steps); gradient clipping is active in every step and the Trainer's
linear schedule decays the rate. Also: the evaluation loss, the learning rates, a user's
callback, the checkpoint's model read by `from_pretrained` (= the single process's weights).
"""

from __future__ import annotations

import math

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from trident.config import ConfigError  # noqa: E402
from trident.tensor_parallel import shard_specs  # noqa: E402
from trident.testing.distributed import cached_mesh, run_on_ranks  # noqa: E402

VOCAB, SEQ, SAMPLES, STEPS = 64, 16, 24, 10
ADAMW_AUTO = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
RUNS = {
    # layout: (trident config, ranks' per-device batch, accumulation, optimizer, lr, max_grad_norm)
    "zero2": ({"zero_optimization": {"stage": 2}, "optimizer": ADAMW_AUTO}, 2, 1, "adamw_torch", 3e-3, 0.5),
    "tp2": ({"tensor_parallel": {"size": 2, "plan": "hf"}}, 4, 1, "sgd", 0.5, 0.05),
    "zero3_accumulation": ({"zero_optimization": {"stage": 3}, "optimizer": ADAMW_AUTO}, 1, 2, "adamw_torch", 3e-3,
                           0.5),
}
GLOBAL_BATCH = 4


def make_model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    config._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(config).float()


def dataset() -> list[dict]:
    ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(3))
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def training_args(out: str, per_device: int, optim: str, lr: float, clip: float, accumulation: int = 1,
                  save: bool = True):
    return transformers.TrainingArguments(
        output_dir=out, max_steps=STEPS, per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation, per_device_eval_batch_size=4, learning_rate=lr, optim=optim,
        max_grad_norm=clip, weight_decay=0.0, logging_steps=1, save_strategy="steps" if save else "no", save_steps=5,
        report_to=[], seed=0, disable_tqdm=True, use_cpu=True, dataloader_num_workers=0)


def logged(history: list[dict], key: str = "loss") -> dict[int, float]:
    return {h["step"]: h[key] for h in history if key in h}


def reference(layout: str, out: str) -> dict:
    *_, optim, lr, clip = RUNS[layout]
    args = training_args(out, GLOBAL_BATCH, optim, lr, clip, save=False)
    trainer = transformers.Trainer(model=make_model(), args=args, train_dataset=dataset(), eval_dataset=dataset()[:8])
    trainer.train()
    return {"losses": logged(trainer.state.log_history), "norms": logged(trainer.state.log_history, "grad_norm"),
            "lrs": logged(trainer.state.log_history, "learning_rate"), "eval_loss": trainer.evaluate()["eval_loss"],
            "weights": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}}


class Seen(transformers.TrainerCallback):
    """What a user's callback sees: every optimizer step's end and every logged loss."""

    def __init__(self) -> None:
        self.step_ends: list[int] = []
        self.logged_losses: dict[int, float] = {}

    def on_step_end(self, args, state, control, **kwargs):
        self.step_ends.append(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.logged_losses[state.global_step] = logs["loss"]


def train_trident(layout: str, out: str) -> dict:
    from trident.integrations.transformers import TridentTrainer

    config, per_device, accumulation, optim, lr, clip = RUNS[layout]
    mesh = cached_mesh(tp=config.get("tensor_parallel", {}).get("size", 1))

    seen = Seen()

    def trainer(callbacks=None):
        return TridentTrainer(model=make_model(), args=training_args(out, per_device, optim, lr, clip, accumulation),
                              train_dataset=dataset(), eval_dataset=dataset()[:8], trident_config=config, mesh=mesh,
                              callbacks=callbacks)

    first = trainer([seen])
    first.train()
    assert seen.step_ends == list(range(1, STEPS + 1)), seen.step_ends
    assert sorted(seen.logged_losses) == list(range(1, STEPS + 1)), seen.logged_losses
    evaluated = first.evaluate()
    resumed = trainer()
    resumed.train(resume_from_checkpoint=f"{out}/checkpoint-5")
    engine = first.engine
    assert first.model_wrapped is engine and first.model is engine.module
    assert engine.zero_optimization_stage() == config.get("zero_optimization", {}).get("stage", 0)
    assert engine.mesh.tp_size == config.get("tensor_parallel", {}).get("size", 1)
    assert bool(shard_specs(engine.module)) == (engine.mesh.tp_size > 1), "tp=2 split nothing"
    return {"losses": logged(first.state.log_history), "norms": logged(first.state.log_history, "grad_norm"),
            "lrs": logged(first.state.log_history, "learning_rate"), "eval_loss": evaluated["eval_loss"],
            "resumed": {s: v for s, v in logged(resumed.state.log_history).items() if s > 5}}


def assert_close(got: dict, want: dict, rtol: float, what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: steps {sorted(got)} vs {sorted(want)}"
    for step in want:
        assert math.isclose(got[step], want[step], rel_tol=rtol), f"{what} at step {step}: {got[step]} vs {want[step]}"


@pytest.mark.parametrize("layout", list(RUNS))
def test_trident_trainer_matches_transformers_trainer_and_resumes(layout, tmp_path):
    ref = reference(layout, str(tmp_path / "ref"))
    clip = RUNS[layout][-1]
    assert len(ref["losses"]) == STEPS and min(ref["norms"].values()) > clip, "clipping must be active in every step"
    results = run_on_ranks(2, train_trident, layout, str(tmp_path / "trident"))
    for r in results:
        assert_close(r["losses"], ref["losses"], 1e-5, "loss")
        assert_close(r["norms"], ref["norms"], 1e-5, "grad_norm")
        assert_close(r["lrs"], ref["lrs"], 1e-9, "learning_rate")
        assert_close(r["resumed"], {s: v for s, v in ref["losses"].items() if s > 5}, 1e-5, "resumed loss")
        assert r["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5)
    saved = tmp_path / "trident" / "checkpoint-10"
    assert (saved / "trainer_state.json").is_file() and (saved / "training_args.bin").is_file()
    assert (saved / "global_step10").is_dir()  # the engine's checkpoint, which resume loads
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(saved)  # whole, as transformers reads it
    state = reloaded.state_dict()
    assert sorted(state) == sorted(ref["weights"])
    for name, want in ref["weights"].items():
        torch.testing.assert_close(state[name], want, rtol=1e-4, atol=1e-6, msg=name)


def evaluate_then_train(out: str) -> dict:
    """No mesh given (built from the config over the world), evaluation before training (the
    engine is built then, its schedule planned from the dataset's length), epochs not steps."""
    from trident.integrations.transformers import TridentTrainer

    args = training_args(out, 2, "sgd", 0.5, 0.05, save=False)
    args.max_steps, args.num_train_epochs = -1, 1
    trainer = TridentTrainer(model=make_model(), args=args, train_dataset=dataset(), eval_dataset=dataset()[:8],
                             trident_config={"zero_optimization": {"stage": 1}})
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    return {"before": before, "losses": logged(trainer.state.log_history),
            "lrs": logged(trainer.state.log_history, "learning_rate")}


def test_trident_trainer_builds_its_mesh_and_evaluates_before_training(tmp_path):
    args = training_args(str(tmp_path / "ref"), GLOBAL_BATCH, "sgd", 0.5, 0.05, save=False)
    args.max_steps, args.num_train_epochs = -1, 1
    ref = transformers.Trainer(model=make_model(), args=args, train_dataset=dataset(), eval_dataset=dataset()[:8])
    before = ref.evaluate()["eval_loss"]
    ref.train()
    for r in run_on_ranks(2, evaluate_then_train, str(tmp_path / "trident")):
        assert r["before"] == pytest.approx(before, rel=1e-6)
        assert len(r["losses"]) == SAMPLES // GLOBAL_BATCH
        assert_close(r["losses"], logged(ref.state.log_history), 1e-5, "loss")
        assert_close(r["lrs"], logged(ref.state.log_history, "learning_rate"), 1e-9, "learning_rate")


@pytest.mark.parametrize("config,key", [
    ({"train_micro_batch_size_per_gpu": 8}, "train_micro_batch_size_per_gpu"),
    ({"train_batch_size": 64}, "train_batch_size"),
    ({"gradient_accumulation_steps": 4}, "gradient_accumulation_steps"),
    ({"zero_optimization": {"stage": 2}}, "zero_optimization.stage"),
])
def test_config_contradicting_training_arguments_is_the_fill_auto_mismatch(config, key, tmp_path):
    from trident.integrations.transformers import TridentTrainer

    args = training_args(str(tmp_path), GLOBAL_BATCH, "sgd", 0.1, 1.0)
    if key == "zero_optimization.stage":
        args.fsdp = "full_shard"  # the Trainer's own sharding, ZeRO stage 3
    with pytest.raises(ConfigError) as err:
        TridentTrainer(model=make_model(), args=args, train_dataset=dataset(), trident_config=config)
    assert [i.path for i in err.value.issues] == [key]
    assert "disagrees with" in str(err.value) and "\"auto\"" in str(err.value)


def ragged_dataset() -> list[dict]:
    """Rows whose labels count very different numbers of tokens (-100 after each row's length)."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
    rows = []
    for i, row in enumerate(ids):
        labels = row.clone()
        labels[int(torch.randint(3, 6, (), generator=g)) if (i // 2) % 2 else SEQ:] = -100  # pairs: full, short
        rows.append({"input_ids": row, "labels": labels})
    return rows


def ragged_run(trident_side: bool, out: str, per_device: int, accumulation: int) -> dict:
    args = training_args(out, per_device, "sgd", 0.5, 0.05, accumulation, save=False)
    if trident_side:
        from trident.integrations.transformers import TridentTrainer
        trainer = TridentTrainer(model=make_model(), args=args, train_dataset=ragged_dataset(), mesh=cached_mesh(),
                                 trident_config={})
    else:
        trainer = transformers.Trainer(model=make_model(), args=args, train_dataset=ragged_dataset())
    trainer.train()
    model = trainer.model
    return {"losses": logged(trainer.state.log_history), "norms": logged(trainer.state.log_history, "grad_norm"),
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@pytest.mark.parametrize("world,per_device,accumulation", [(1, 2, 2), (2, 2, 1)])
def test_ragged_labels_train_as_transformers_trainer_normalizes_them(world, per_device, accumulation, tmp_path):
    """transformers' Trainer divides a window's token losses by their count (`num_items_in_batch`):
    TridentTrainer passes the same count, summed over its data-parallel ranks, so one process
    with accumulation and two ranks without train as one process does."""
    ref = ragged_run(False, str(tmp_path / "ref"), 4 // accumulation if world == 1 else 4, accumulation if world == 1
                     else 1)
    for got in run_on_ranks(world, ragged_run, True, str(tmp_path / "trident"), per_device, accumulation):
        assert_close(got["losses"], ref["losses"], 1e-5, "loss")
        assert_close(got["norms"], ref["norms"], 1e-5, "grad_norm")
        for k, v in ref["weights"].items():
            assert torch.allclose(got["weights"][k], v, rtol=1e-5, atol=1e-7), k
