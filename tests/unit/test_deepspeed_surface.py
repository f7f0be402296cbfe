"""DeepSpeed 0.19's whole public surface (trident.deepspeed.engine.surface): every name of DeepSpeedEngine,
PipelineEngine and the `deepspeed` package is implemented with DeepSpeed's meaning and return
type, or raises an error naming it and saying what to use instead (issue 32, item 2)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch

import trident
from trident.deepspeed.engine import surface
from trident.deepspeed.accelerator import CPU_Accelerator, get_accelerator
from trident.deepspeed.engine.settings import SWITCHED_OFF, ZERO_SETTINGS
from trident.deepspeed.engine.surface import NotInTrident
from trident.testing.distributed import cached_mesh, run_on_ranks

CONFIG = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 0, "gradient_clipping": 0.5,
          "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, "zero_optimization": {"stage": 1}}


def test_the_lists_are_deepspeeds_and_unsupported_names_are_on_them():
    assert len(surface.ENGINE) > 250 and len(set(surface.ENGINE)) == len(surface.ENGINE)
    assert {"fp16_enabled", "bfloat16_enabled", "zero_optimization", "gradient_clipping", "get_mom",
            "steps_per_print", "get_data_types", "communication_data_type", "wall_clock_breakdown", "monitor", "mpu",
            "zero_optimization_partition_gradients", "dump_state", "loss_scale"} <= set(surface.ENGINE)
    assert set(surface.ENGINE_UNSUPPORTED) <= set(surface.ENGINE)
    assert set(surface.PIPELINE_UNSUPPORTED) <= set(surface.PIPELINE_ENGINE) | set(surface.ENGINE)
    assert set(surface.PACKAGE_UNSUPPORTED) <= set(surface.PACKAGE)
    assert {"get_accelerator", "init_inference", "log_dist", "logger"} <= set(surface.PACKAGE)


def walk_engine(pipeline: bool) -> dict:
    """Every DeepSpeed engine name read on a real engine: implemented, or refused by name."""
    mesh = cached_mesh()
    if pipeline:
        model = trident.PipelineModule([torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)], num_stages=1,
                                       loss_fn=torch.nn.CrossEntropyLoss())
    else:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    engine, *_ = trident.initialize(model=model, config=CONFIG, mesh=mesh)
    names = surface.ENGINE + (surface.PIPELINE_ENGINE if pipeline else ())
    table = surface.PIPELINE_UNSUPPORTED | surface.ENGINE_UNSUPPORTED if pipeline else surface.ENGINE_UNSUPPORTED
    problems = []
    for name in names:
        try:
            getattr(engine, name)
            if name in table:
                problems.append(f"{name}: listed as unsupported but present")
        except NotInTrident as err:
            if name not in table or name not in str(err):
                problems.append(f"{name}: {err}")
        except Exception as err:  # noqa: BLE001
            problems.append(f"{name}: {type(err).__name__}: {err}")
    answers = {n: getattr(engine, n)() for n in SWITCHED_OFF}
    answers.update({n: getattr(engine, n)() for n in ZERO_SETTINGS})
    calls = {n: getattr(engine, n)() for n in (
        "fp16_enabled", "bfloat16_enabled", "zero_optimization", "zero_optimization_stage", "gradient_clipping",
        "get_mom", "steps_per_print", "get_data_types", "wall_clock_breakdown", "zero_optimization_partition_gradients",
        "dump_state", "get_batch_info", "optimizer_name", "get_lr", "dataloader_drop_last", "postscale_gradients",
        "train_batch_size", "get_data_parallel_rank", "get_model_parallel_rank", "dynamic_loss_scale",
        "flops_profiler_enabled", "flops_profiler_profile_step")}
    attrs = {n: getattr(engine, n) for n in ("communication_data_type", "mpu", "mp_world_size", "pipeline_parallelism",
                                              "gradient_average", "client_optimizer", "dist_backend")}
    refusals = {n: str(e) for n in ("autotuning_metric", "allreduce_gradients", "register_compile_pass")
                for e in [_error(engine, n)]}
    return {"problems": problems, "calls": calls, "attrs": attrs, "loss_scale": (float(engine.loss_scale),
            engine.loss_scale()), "monitor": engine.monitor is engine.monitors, "answers": answers,
            "refusals": refusals}


def _error(engine, name):
    try:
        getattr(engine, name)
    except NotInTrident as err:
        return err
    return None


@pytest.mark.parametrize("pipeline", [False, True])
def test_every_engine_name_is_implemented_or_refused_by_name(pipeline):
    [found] = run_on_ranks(1, walk_engine, pipeline)
    assert found["problems"] == []
    calls = found["calls"]
    assert (calls["fp16_enabled"], calls["bfloat16_enabled"], calls["zero_optimization"]) == (False, False, True)
    assert (calls["zero_optimization_stage"], calls["gradient_clipping"], calls["get_mom"]) == (1, 0.5, [0.9])
    assert calls["get_data_types"] == (torch.float32, torch.float32) and calls["get_batch_info"] == (8, 4, 2)
    assert (calls["optimizer_name"], calls["dump_state"], calls["zero_optimization_partition_gradients"]) == \
        ("SGD", False, False)
    assert calls["steps_per_print"] == 0 and calls["wall_clock_breakdown"] is False and calls["postscale_gradients"]
    assert found["attrs"]["communication_data_type"] == torch.float32 and found["attrs"]["mpu"] is None
    assert found["attrs"]["dist_backend"] == "gloo" and found["attrs"]["client_optimizer"] is None
    assert found["loss_scale"] == (1.0, 0.0) and found["monitor"]
    assert (calls["flops_profiler_enabled"], calls["flops_profiler_profile_step"]) == (False, 1)
    assert found["answers"]["autotuning_enabled"] is False and found["answers"]["zero_reduce_bucket_size"] > 0
    for name, message in found["refusals"].items():
        assert name in message and "trident" in message, message


def test_every_package_name_is_there_or_refused_by_name():
    for name in surface.PACKAGE:
        if name in surface.PACKAGE_UNSUPPORTED:
            with pytest.raises(NotInTrident, match=name):
                getattr(trident, name)
            assert not hasattr(trident, name)
        else:
            assert hasattr(trident, name), name
    assert trident.DeepSpeedEngine is trident.Engine and issubclass(trident.PipelineEngine, trident.Engine)
    assert trident.DeepSpeedConfigError is trident.config.ConfigError and trident.dist is trident.comm
    with pytest.raises(AttributeError, match="no attribute 'not_a_deepspeed_name'"):
        trident.not_a_deepspeed_name


def test_cpu_accelerator_answers():
    accel = get_accelerator() if not torch.cuda.is_available() else CPU_Accelerator()
    assert accel.device_name() == "cpu" and accel.device_name(0) == "cpu" and accel.current_device_name() == "cpu"
    assert isinstance(accel.current_device(), int) and accel.device_count() >= 1
    assert accel.synchronize() is None and accel.communication_backend_name() == "gloo"
    assert accel.is_bf16_supported() is True and isinstance(accel.is_fp16_supported(), bool)
    assert torch.bfloat16 in accel.supported_dtypes() and torch.float in accel.supported_dtypes()
    assert accel.memory_allocated() > 0 and accel.max_memory_allocated() >= accel.memory_allocated()
    assert accel.total_memory() >= accel.available_memory() > 0
    assert set(accel.memory_stats()) >= {"allocated_bytes.all.current", "allocated_bytes.all.peak"}
    accel.manual_seed(5)
    a = torch.rand(3)
    accel.manual_seed_all(5)
    assert torch.equal(a, torch.rand(3)) and accel.initial_seed() == 5
    state = accel.get_rng_state()
    b = torch.rand(2)
    accel.set_rng_state(state)
    assert torch.equal(b, torch.rand(2))
    assert accel.on_accelerator(torch.zeros(1)) and accel.is_synchronized_device()
    with pytest.raises(NotInTrident, match="create_op_builder"):
        accel.create_op_builder("CPUAdamBuilder")


def test_accelerator_choice_follows_ds_accelerator():
    code = "from trident.deepspeed.accelerator import get_accelerator\nprint(get_accelerator().device_name())\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**_env(), "DS_ACCELERATOR": "cpu"})
    assert out.stdout.strip() == "cpu", out.stderr
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**_env(), "DS_ACCELERATOR": "xpu"})
    assert "DS_ACCELERATOR='xpu'" in bad.stderr


def _env() -> dict:
    import os
    return dict(os.environ)


def test_runtime_modules_carry_deepspeeds_names():
    for module, names in {
        "trident.deepspeed.runtime.utils": "set_random_seed see_memory_usage",
        "trident.deepspeed.runtime.dataloader": "RepeatingLoader DeepSpeedDataLoader",
        "trident.deepspeed.runtime.engine": "DeepSpeedEngine ADAM_OPTIMIZER",
        "trident.deepspeed.runtime.pipe": "PipelineModule LayerSpec TiedLayerSpec",
        "trident.deepspeed.runtime.pipe.engine": "PipelineEngine",
        "trident.deepspeed.runtime.pipe.topology": "PipeModelDataParallelTopology",
        "trident.deepspeed.runtime.lr_schedules": "WarmupLR WarmupDecayLR OneCycle add_tuning_arguments",
        "trident.deepspeed.runtime.activation_checkpointing.checkpointing": "checkpoint configure",
        "trident.deepspeed.runtime.zero.partition_parameters": "Init GatheredParameters",
        "trident.deepspeed.runtime.config": "DeepSpeedConfig DeepSpeedConfigError",
        "trident.utils": "log_dist log_dist_once logger OnDevice RepeatingLoader",
    }.items():
        mod = importlib.import_module(module)
        assert all(hasattr(mod, n) for n in names.split()), (module, [n for n in names.split() if not hasattr(mod, n)])


def test_set_random_seed_seeds_python_numpy_and_torch():
    import random

    import numpy as np

    from trident.deepspeed.runtime.utils import set_random_seed
    set_random_seed(3)
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    set_random_seed(3)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


def test_on_device_builds_on_meta_in_the_dtype():
    from trident.utils import OnDevice
    with OnDevice(dtype=torch.bfloat16, device="meta"):
        layer = torch.nn.Linear(4, 4)
    assert layer.weight.device.type == "meta" and layer.weight.dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32 and torch.zeros(1).device.type == "cpu"
