"""Config spellings DeepSpeed runs (issue 32, item 7): accepted as DeepSpeed reads them; and an
unknown section that is switched on is an error naming it, not a run without it."""

import pytest

import trident  # noqa: F401  (registers the DeepSpeed dialect and the optimizer rules)
from trident.config import ConfigError, load_config

BASE = {"train_micro_batch_size_per_gpu": 2}


def load(**extra):
    return load_config({**BASE, **extra})


@pytest.mark.parametrize("spelling", ["bfp16", "BFP16", "bf16"])
def test_communication_data_type_bfp16(spelling):
    assert load(communication_data_type=spelling).communication_data_type == "bf16"


def test_integer_keys_written_as_whole_floats():
    cfg = load(steps_per_print=100000.0, gradient_accumulation_steps=2.0,
               zero_optimization={"stage": 2.0, "reduce_bucket_size": 5e8}, pipeline={"stages": 1.0})
    assert (cfg.steps_per_print, cfg.gradient_accumulation_steps, cfg.zero_optimization.stage) == (100000, 2, 2)
    assert isinstance(cfg.steps_per_print, int) and cfg.zero_optimization.reduce_bucket_size == 500_000_000
    with pytest.raises(ConfigError, match="steps_per_print"):
        load(steps_per_print=10.5)  # not a whole number: still refused


def test_steps_per_print_infinity_is_never(tmp_path):
    """accelerate writes steps_per_print = float("inf") into every DeepSpeed config it builds."""
    assert load(steps_per_print=float("inf")).steps_per_print is None
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 2, "steps_per_print": Infinity}')
    assert load_config(str(path)).steps_per_print is None
    with pytest.raises(ConfigError, match="steps_per_print"):
        load(steps_per_print=float("-inf"))


def test_zero_lr_is_accepted_and_a_negative_one_refused():
    cfg = load(optimizer={"type": "AdamW", "params": {"lr": 0.0}},
               scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 5}})
    assert cfg.optimizer.params["lr"] == 0.0
    with pytest.raises(ConfigError, match="optimizer.params.lr: expected a non-negative number, got -0.5"):
        load(optimizer={"type": "SGD", "params": {"lr": -0.5}})


def test_autotp_size_is_tensor_parallel_size_with_the_auto_plan():
    cfg = load(tensor_parallel={"autotp_size": 2})
    assert (cfg.tensor_parallel.size, cfg.tensor_parallel.plan) == (2, "auto")
    assert load(tensor_parallel={"autotp_size": 2, "plan": "llama"}).tensor_parallel.plan == "llama"
    assert load(tensor_parallel={"autotp_size": 1}).tensor_parallel.size == 1
    with pytest.raises(ConfigError, match="tensor_parallel.autotp_size: 2 disagrees with tensor_parallel.size=4"):
        load(tensor_parallel={"autotp_size": 2, "size": 4})
    with pytest.raises(ConfigError, match="tensor_parallel.autotp_size: expected a positive integer"):
        load(tensor_parallel={"autotp_size": "two"})


def test_unknown_section_switched_on_is_an_error_naming_it():
    with pytest.raises(ConfigError) as err:
        load(transformer_engine={"enabled": True, "format": "e4m3"})
    [issue] = err.value.issues
    assert issue.path == "transformer_engine" and "`transformer_engine.enabled: true`" in issue.message
    assert "set its `enabled` to false" in issue.message
    with pytest.raises(ConfigError, match="my_feature.inner.enabled"):
        load(my_feature={"inner": {"enabled": 1}})


def test_unknown_key_that_switches_nothing_on_stays_a_note():
    for extra in ({"transformer_engine": {"enabled": False}}, {"my_project": {"name": "x"}}, {"my_flag": True}):
        cfg = load(**extra)
        assert [n.kind for n in cfg._notes] == ["unknown"], cfg._notes
