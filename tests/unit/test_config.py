"""Config parsing: DeepSpeed's defaults, "auto", aliases, the resolved JSON, batch rules, the CLI."""

import json
import sys
import types
import warnings

import pydantic
import pytest

from trident.cli import config_check
from trident.config import (BatchSizes, ConfigError, ConfigIssue, TridentConfig, batch_issues, load_config,
                            resolve_batch)
from trident.config import loader as loader_module
from trident.config.errors import section_type


def test_defaults_match_deepspeed_and_the_brief():
    cfg = load_config({})
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (None,) * 3
    assert cfg.optimizer is None and cfg.scheduler is None
    fp16 = cfg.fp16
    assert (fp16.enabled, fp16.loss_scale, fp16.initial_scale_power, fp16.loss_scale_window, fp16.hysteresis,
            fp16.consecutive_hysteresis, fp16.min_loss_scale) == (False, 0.0, 16, 1000, 2, False, 1.0)
    assert cfg.bf16.enabled is False
    assert (cfg.gradient_clipping, cfg.gradient_predivide_factor, cfg.prescale_gradients) == (0.0, 1.0, False)
    assert (cfg.steps_per_print, cfg.wall_clock_breakdown, cfg.seed) == (10, False, 1234)
    assert cfg.comms_logger.model_dump() == {"enabled": False, "verbose": False, "prof_all": True, "prof_ops": [],
                                             "debug": False}
    for monitor in (cfg.tensorboard, cfg.csv_monitor):
        assert (monitor.enabled, monitor.output_path, monitor.job_name) == (False, "", "DeepSpeedJobName")
    assert cfg.distributed.timeout_s == 1800.0
    zero = cfg.zero_optimization
    assert (zero.stage, zero.reduce_bucket_size, zero.allgather_bucket_size) == (0, 500_000_000, 500_000_000)
    assert zero.overlap_comm is True  # stage 0's default: the reducer overlaps all-reduce with backward
    assert (cfg.model.type, cfg.model.preset, cfg.model.dropout) == ("gpt", None, 0.0)
    assert (cfg.data.dataset, cfg.data.shuffle, cfg.data.val_fraction) == ("kjv", True, 0.01)
    assert (cfg.trainer.train_steps, cfg.trainer.run_dir, cfg.trainer.save_interval) == (150, "runs", 0)


def test_overlap_comm_explicit_false_is_kept():
    assert load_config({"zero_optimization": {"overlap_comm": False}}).zero_optimization.overlap_comm is False


def test_every_field_of_every_section_is_documented():
    pending, seen = [TridentConfig], set()
    while pending:
        model = pending.pop()
        seen.add(model)
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            sub = section_type(field.annotation)
            if sub is not None and sub not in seen:
                pending.append(sub)
    assert len(seen) >= 13


def test_auto_means_unset():
    cfg = load_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2,
                       "gradient_accumulation_steps": "auto"})
    assert cfg.train_batch_size is None and cfg.gradient_accumulation_steps is None
    assert resolve_batch(cfg, 3) == BatchSizes(6, 2, 1)


def test_deprecated_alias_maps_and_warns_once(monkeypatch):
    monkeypatch.setattr(loader_module, "_warned_aliases", set())
    with pytest.warns(FutureWarning, match="config key `bfloat16` is deprecated; write `bf16` instead"):
        cfg = load_config({"bfloat16": {"enabled": True}})
    assert cfg.bf16.enabled is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config({"bfloat16": {"enabled": True}}).bf16.enabled is True


def test_resolved_json_round_trips(tmp_path):
    cfg = load_config({"train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": True, "loss_scale": 128},
                       "optimizer": {"type": "adamw", "params": {"lr": 3e-4, "betas": [0.9, 0.95]}},
                       "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
                       "comms_logger": {"enabled": True, "prof_ops": ["all_reduce"]}})
    path = tmp_path / "config.json"
    path.write_text(cfg.resolved_json())
    again = load_config(path)
    assert again == cfg
    assert again.to_dict() == json.loads(path.read_text())


def test_optimizer_and_scheduler_sections_are_resolved():
    cfg = load_config({"optimizer": {"type": "adam", "params": {"lr": 0.01}},
                       "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100}}})
    assert cfg.optimizer.type == "Adam"
    assert cfg.optimizer.params == {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
                                    "bias_correction": True, "amsgrad": False, "adam_w_mode": True,
                                    "torch_adam": False}
    assert cfg.scheduler.params["warmup_max_lr"] == 0.001 and cfg.scheduler.params["warmup_type"] == "log"


def test_all_errors_are_reported_together():
    with pytest.raises(ConfigError) as info:
        load_config({"fp16": {"enabled": "yes"}, "train_batch_size": -4, "wall_clock": True,
                     "optimizer": {"type": "Adam", "params": {"lr": -1}}, "zero_optimization": {"stage": 5}})
    paths = [i.path for i in info.value.issues]
    assert paths == sorted(["fp16.enabled", "train_batch_size", "wall_clock", "optimizer.params.lr",
                            "zero_optimization.stage"])
    assert str(info.value).splitlines() == [str(i) for i in info.value.issues]


def test_cross_field_rule_is_reported_with_unknown_keys():
    with pytest.raises(ConfigError) as info:
        load_config({"fp16": {"enabled": True}, "bf16": {"enabled": True}, "sed": 1})
    assert [i.path for i in info.value.issues] == ["fp16.enabled", "sed"]


def test_config_is_read_only_and_passes_through():
    cfg = load_config({"seed": 7})
    with pytest.raises(pydantic.ValidationError):
        cfg.seed = 8
    assert load_config(cfg) is cfg


def test_dict_source_is_not_modified():
    source = {"bfloat16": {"enabled": False}, "optimizer": {"type": "sgd", "params": {"lr": 0.1}}}
    snapshot = json.loads(json.dumps(source))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the alias warning is tested above
        load_config(source)
    assert source == snapshot


def test_model_preset_is_checked_when_set(monkeypatch):
    fake = types.ModuleType("trident.models.gpt")
    fake.GPT_PRESETS = {"demo": {}, "small": {}}
    monkeypatch.setitem(sys.modules, "trident.models.gpt", fake)
    assert load_config({"model": {"preset": "small"}}).model.preset == "small"
    with pytest.raises(ConfigError, match="model.preset: unknown preset 'smal'; did you mean 'small'"):
        load_config({"model": {"preset": "smal"}})


@pytest.mark.parametrize("given,dp,expected", [
    ((32, 4, 2), 4, (32, 4, 2)),   # all three, consistent
    ((32, 4, None), 2, (32, 4, 4)),  # train + micro -> accumulation
    ((32, None, 2), 4, (32, 4, 2)),  # train + accumulation -> micro
    ((None, 4, 2), 3, (24, 4, 2)),   # micro + accumulation -> train
    ((16, None, None), 4, (16, 4, 1)),  # train only -> no accumulation
    ((None, 5, None), 2, (10, 5, 1)),   # micro only -> no accumulation
])
def test_batch_triangle(given, dp, expected):
    cfg = load_config(dict(zip(["train_batch_size", "train_micro_batch_size_per_gpu",
                                "gradient_accumulation_steps"], given)))
    assert resolve_batch(cfg, dp) == BatchSizes(*expected)


def test_batch_issues_without_dp_size_only_flags_what_no_dp_fixes():
    assert batch_issues(load_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4})) == []
    [issue] = batch_issues(load_config({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}))
    assert issue.path == "train_batch_size" and "30 is not a multiple of" in issue.message
    [issue] = batch_issues(load_config({"gradient_accumulation_steps": 2}))
    assert "neither train_batch_size nor train_micro_batch_size_per_gpu is set" in issue.message


def test_resolve_batch_rejects_bad_dp_size():
    with pytest.raises(ValueError, match="dp_size must be a positive integer, got 0"):
        resolve_batch(load_config({"train_micro_batch_size_per_gpu": 1}), 0)


def test_config_error_shape():
    err = ConfigError([ConfigIssue("a.b", "first"), ConfigIssue("c", "second")])
    assert isinstance(err, ValueError) and str(err) == "a.b: first\nc: second"


# -- the CLI -----------------------------------------------------------------------------------------

def write(tmp_path, config) -> str:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_cli_prints_resolved_config(tmp_path, capsys):
    path = write(tmp_path, {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})
    assert config_check.main(["check", path]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fp16"]["initial_scale_power"] == 16 and out["train_batch_size"] is None


def test_cli_resolves_batch_for_world_size(tmp_path, capsys):
    path = write(tmp_path, {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})
    assert config_check.main(["check", path, "--world-size", "3"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["train_batch_size"] == 24
    assert "batch: train_batch_size 24 = micro 4 x accumulation 2 x data-parallel size 3" in captured.err


def test_cli_reports_every_error_and_exits_1(tmp_path, capsys):
    path = write(tmp_path, {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "fp16": {"enabld": True},
                            "zero_optimization": {"stage": 9}})
    assert config_check.main(["check", path]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "2 problems" in captured.err
    assert "fp16.enabld: unknown key; did you mean 'enabled'?" in captured.err
    assert "zero_optimization.stage: expected one of 0, 1, 2, 3 (the ZeRO stage), got 9" in captured.err


def test_cli_batch_contradiction_for_world_size(tmp_path, capsys):
    path = write(tmp_path, {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                            "gradient_accumulation_steps": 2})
    assert config_check.main(["check", path, "--world-size", "2"]) == 1
    assert "train_batch_size: 32 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 2" \
        in capsys.readouterr().err


def test_cli_missing_file(tmp_path, capsys):
    assert config_check.main(["check", str(tmp_path / "missing.json")]) == 1
    assert "cannot read the config file" in capsys.readouterr().err


def test_cli_rejects_bad_world_size(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        config_check.main(["check", write(tmp_path, {}), "--world-size", "0"])
    assert info.value.code == 2
    assert "expected a positive integer, got '0'" in capsys.readouterr().err


def test_zero_keys_that_do_not_apply_to_the_stage_are_listed():
    cfg = load_config({"zero_optimization": {"stage": 2, "stage3_prefetch_bucket_size": 5,
                                             "stage3_param_persistence_threshold": 100_000,
                                             "contiguous_gradients": False, "reduce_scatter": False}})
    assert cfg.zero_optimization.inapplicable_keys() == ["stage3_prefetch_bucket_size"]
    cfg = load_config({"zero_optimization": {"stage": 1, "contiguous_gradients": False}})
    assert cfg.zero_optimization.inapplicable_keys() == ["contiguous_gradients"]
    cfg = load_config({"zero_optimization": {"stage": 3, "round_robin_gradients": True, "sub_group_size": 5e8}})
    assert cfg.zero_optimization.inapplicable_keys() == ["round_robin_gradients"]


def test_deepspeed_aliases_and_float_counts_in_zero():
    cfg = load_config({"zero_optimization": {"stage": 3, "prefetch_bucket_size": 2e7,
                                             "param_persistence_threshold": 1e4, "reduce_bucket_size": 5e8}})
    z = cfg.zero_optimization
    assert (z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold, z.reduce_bucket_size) == \
        (20_000_000, 10_000, 500_000_000)


def test_pipeline_micro_batches_stand_for_gradient_accumulation():
    cfg = load_config({"train_micro_batch_size_per_gpu": 2, "pipeline": {"stages": 2, "micro_batches": 8}})
    assert resolve_batch(cfg, 3) == resolve_batch(load_config(
        {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8}), 3)
