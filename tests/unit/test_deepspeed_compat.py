"""DeepSpeed's dialect: what trident accepts, ignores (listed), renames and refuses, the
Hugging Face "auto" fill, and the DeepSpeed module surface (no processes)."""

from __future__ import annotations

import argparse
import json
import warnings

import pytest
import torch

import trident
import trident as deepspeed
from trident.cli.config_check import main as config_check
from trident.config import ConfigError, fill_auto, load_config
from trident.deepspeed.config import startup_lines


def notes(cfg) -> dict[str, str]:
    return {n.path: n.kind for n in cfg._notes}


def error(config: dict, **kw) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config, **kw)
    return str(info.value)


# -- accepted and ignored ---------------------------------------------------------------------------

def test_keys_that_change_nothing_are_ignored_and_listed_once():
    cfg = load_config({"train_micro_batch_size_per_gpu": 2, "zero_allow_untested_optimizer": True,
                       "bf16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
                       "fp16": {"auto_cast": True}, "autotuning": {"enabled": False, "start_profile_step": 3},
                       "zero_optimization": {"stage": 2, "allgather_partitions": True},
                       "memory_breakdown": False})
    assert notes(cfg) == {"zero_allow_untested_optimizer": "ignored", "bf16.loss_scale": "ignored",
                          "bf16.initial_scale_power": "ignored", "fp16.auto_cast": "ignored",
                          "autotuning": "ignored", "zero_optimization.allgather_partitions": "ignored",
                          "memory_breakdown": "ignored"}
    lines = startup_lines(list(cfg._notes))
    assert len(lines) == 1 and "bf16 needs no loss scaling" in lines[0] and "7 DeepSpeed key(s)" in lines[0]
    assert cfg.bf16.enabled and cfg.zero_optimization.stage == 2


def test_unknown_top_level_and_comment_keys_are_accepted_with_a_note():
    cfg = load_config({"train_micro_batch_size_per_gpu": 2, "my_project_setting": 3, "_comment": "x",
                       "zero_optimization": {"comment": "stage two", "stage": 2}})
    assert notes(cfg) == {"my_project_setting": "unknown", "_comment": "unknown",
                          "zero_optimization.comment": "unknown"}
    assert "unknown key(s) ignored" in startup_lines(list(cfg._notes))[0]


def test_strict_makes_unknown_keys_errors():
    text = error({"my_project_setting": 3, "_comment": "x", "strict": True})
    assert "my_project_setting: unknown key, an error because \"strict\" is true" in text
    assert "_comment: unknown key" in text
    assert "my_project_setting" in error({"my_project_setting": 3}, strict=True)
    assert "strict: expected true or false" in error({"strict": "yes"})


def test_a_typo_stays_an_error_with_did_you_mean():
    assert "train_batch_sise: unknown key; did you mean 'train_batch_size'?" in error({"train_batch_sise": 8})
    assert "zero_optimisation: unknown key; did you mean 'zero_optimization'?" in error({"zero_optimisation": {}})
    assert "wall_clock: unknown key; did you mean 'wall_clock_breakdown'?" in error({"wall_clock": True})
    # inside a section an unknown key is an error, as in DeepSpeed's own sections
    assert "zero_optimization.stagee: unknown key; did you mean 'stage'?" in error(
        {"zero_optimization": {"stagee": 1}})


def test_legacy_names_map_to_todays():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config({"train_micro_batch_size_per_gpu": 2, "bfloat16": {"enabled": True},
                           "zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_params": True,
                                                 "cpu_offload_use_pin_memory": True,
                                                 "stage3_gather_fp16_weights_on_model_save": True}})
    assert cfg.bf16.enabled
    z = cfg.zero_optimization
    assert (z.offload_optimizer.device, z.offload_param.device) == ("cpu", "cpu")
    assert z.offload_optimizer.pin_memory and z.offload_param.pin_memory
    assert z.stage3_gather_16bit_weights_on_model_save
    assert any("deprecated" in str(w.message) for w in caught)
    assert load_config({"train_micro_batch_size_per_gpu": 2, "zero_optimization": True}).zero_optimization.stage == 1


def test_an_enabled_feature_trident_lacks_is_refused_by_name():
    assert "autotuning: {\"enabled\": true} asks for DeepSpeed's autotuner (see `trident plan`), which trident does " \
        "not implement" in error({"autotuning": {"enabled": True}})
    assert "asks for ZeRO++ LoCo error feedback" in error(
        {"zero_optimization": {"zeropp_loco_param": {"err_beta": 0.8}}})
    assert "bf16.bf16_master_weights_and_grads: true asks for bf16 master weights" in error(
        {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}})
    assert "sparse_gradients: true asks for sparse embedding gradients" in error({"sparse_gradients": True})


# -- Hugging Face "auto" --------------------------------------------------------------------------

HF = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
      "gradient_clipping": "auto", "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
      "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
      "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                        "warmup_num_steps": "auto", "total_num_steps": "auto"}},
      "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                            "stage3_param_persistence_threshold": "auto"}}


def training_args(**kw):
    from transformers import TrainingArguments
    base = dict(output_dir="/tmp/trident-unused", per_device_train_batch_size=4, gradient_accumulation_steps=3,
                learning_rate=2e-4, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6, weight_decay=0.1,
                max_grad_norm=0.5, max_steps=200, warmup_steps=20, report_to=[])
    return TrainingArguments(**{**base, **kw})


class HFModel(torch.nn.Module):
    class config:  # noqa: N801 - transformers' attribute name
        hidden_size = 32


def test_fill_auto_follows_transformers():
    filled = fill_auto(HF, training_args(), model=HFModel())
    assert (filled["train_micro_batch_size_per_gpu"], filled["gradient_accumulation_steps"],
            filled["train_batch_size"]) == (4, 3, 12)
    assert filled["gradient_clipping"] == 0.5
    assert filled["optimizer"]["params"] == {"lr": 2e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}
    assert filled["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 2e-4, "warmup_num_steps": 20,
                                             "total_num_steps": 200}
    assert filled["fp16"]["enabled"] is False and filled["bf16"]["enabled"] is False
    z = filled["zero_optimization"]
    assert (z["reduce_bucket_size"], z["stage3_prefetch_bucket_size"], z["stage3_param_persistence_threshold"]) == \
        (32 * 32, int(0.9 * 32 * 32), 320)
    assert HF["gradient_clipping"] == "auto"  # the input is not changed
    load_config(filled)


def test_fill_auto_refuses_a_value_that_contradicts_the_arguments():
    with pytest.raises(ConfigError, match="gradient_accumulation_steps: 5 disagrees with .* = 3"):
        fill_auto({**HF, "gradient_accumulation_steps": 5}, training_args())


def test_leftover_auto_names_the_key_and_what_fills_it():
    text = error({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})
    assert "optimizer.params.lr: \"auto\" is a Hugging Face placeholder" in text
    assert "TrainingArguments.learning_rate" in text and "fill_auto(config, training_args)" in text


# -- the module surface ----------------------------------------------------------------------------

def test_deepspeed_names_exist():
    for name in ("init_distributed", "add_config_arguments", "initialize", "comm", "pipe", "ops", "utils", "zero",
                 "checkpointing"):
        assert hasattr(deepspeed, name), name
    for name in ("init_distributed", "is_initialized", "get_rank", "get_world_size", "get_local_rank", "barrier",
                 "broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                 "all_to_all_single", "send", "recv", "ReduceOp", "new_group"):
        assert callable(getattr(deepspeed.comm, name)) or name == "ReduceOp", name
    from trident.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from trident.pipe import LayerSpec, PipelineModule, TiedLayerSpec  # noqa: F401
    from trident.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: F401
    p = torch.nn.Parameter(torch.ones(3))
    assert isinstance(FusedAdam([p], lr=0.1), torch.optim.Adam) and isinstance(DeepSpeedCPUAdam([p]), torch.optim.Adam)
    for method in ("train_batch", "eval_batch", "zero_optimization_stage", "gradient_accumulation_steps",
                   "train_micro_batch_size_per_gpu", "train_batch_size", "was_step_applied",
                   "set_gradient_accumulation_boundary", "no_sync", "get_lr", "get_global_grad_norm",
                   "save_16bit_model", "load_checkpoint", "device", "local_rank"):
        assert hasattr(trident.Engine, method), method


def test_add_config_arguments_takes_both_spellings():
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    assert parser.parse_args(["--deepspeed", "--deepspeed_config", "a.json"]).deepspeed_config == "a.json"
    args = parser.parse_args(["--trident", "--trident_config", "b.json"])
    assert args.deepspeed and args.deepspeed_config == "b.json"


def test_what_trident_cannot_do_is_refused_by_name():
    with pytest.raises(NotImplementedError, match="ProcessTopology is not supported"):
        deepspeed.pipe.ProcessTopology(axes=["pipe", "data"], dims=[2, 1])
    with pytest.raises(ValueError, match="topology=.* is not supported"):
        deepspeed.pipe.PipelineModule([torch.nn.Linear(2, 2)], topology=object())
    with pytest.raises(ValueError, match="'udp://x:1'"):
        deepspeed.init_distributed(init_method="udp://x:1", rank=0, world_size=1)
    with pytest.raises(ValueError, match="remote_device='nvme'"):
        deepspeed.zero.Init(remote_device="nvme")
    with pytest.raises(NotImplementedError, match="split sizes"):
        deepspeed.comm.all_to_all_single(torch.zeros(2), torch.zeros(2), output_split_sizes=[1, 1])
    with pytest.raises(ValueError, match="bias_correction=False"):
        deepspeed.ops.adam.FusedAdam([torch.nn.Parameter(torch.ones(1))], bias_correction=False)


def test_config_check_strict_flag(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_allow_untested_optimizer": True,
                                "my_key": 1}))
    assert config_check(["check", str(path)]) == 0
    err = capsys.readouterr().err
    assert "zero_allow_untested_optimizer" in err and "my_key" in err
    assert config_check(["check", str(path), "--strict"]) == 1
    assert "my_key: unknown key, an error because \"strict\" is true" in capsys.readouterr().err
