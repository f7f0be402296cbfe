"""DeepSpeed 0.19's user-facing behaviours (issue 42), each as DeepSpeed does it, in one process."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import trident
import trident as deepspeed
from trident.testing.distributed import cached_mesh, run_on_ranks

CONFIG = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 0,
          "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def _backward_returns() -> None:
    engine, *_ = trident.initialize(model=torch.nn.Linear(4, 1), config=CONFIG, mesh=cached_mesh())
    loss = engine(torch.ones(4, 4)).pow(2).mean()
    out = engine.backward(loss)
    torch.testing.assert_close(out, loss / 2, rtol=0, atol=0)
    engine.step()
    loss = engine(torch.ones(4, 4)).pow(2).mean()
    torch.testing.assert_close(engine.backward(loss, scale_wrt_gas=False), loss, rtol=0, atol=0)
    engine.step()


def _config_reads_as_a_dict() -> None:
    config = {**CONFIG, "zero_optimization": {"stage": 1}, "my_key": {"a": 1}}
    engine, *_ = trident.initialize(model=torch.nn.Linear(4, 1), config=config, mesh=cached_mesh())
    # transformers' save_model: self.deepspeed.config.get("zero_optimization", {}).get("stage", None) == 3
    assert engine.config.get("zero_optimization", {}).get("stage") == 1
    assert engine.config.get("tensor_parallel", {}).get("autotp_size", 1) == 1  # absent: the default
    assert engine.config.get("my_key", "absent") == "absent"  # a key trident does not keep
    assert engine.config.get("gradient_clipping") == 0.0
    assert engine.config.zero_optimization.stage == 1  # trident's typed view is unchanged


def test_engine_config_reads_as_the_dict_it_was_given():
    """DeepSpeed's engine.config is the config dict passed to initialize; transformers calls .get on it."""
    run_on_ranks(1, _config_reads_as_a_dict)


def test_backward_returns_the_loss_divided_by_accumulation_steps():
    """DeepSpeed's engine.backward returns loss / gradient_accumulation_steps (here 2)."""
    run_on_ranks(1, _backward_returns)


def test_initialize_without_model_asserts_as_deepspeed():
    with pytest.raises(AssertionError, match="deepspeed.initialize requires a model"):
        deepspeed.initialize(model=None, config=CONFIG)


def test_disabled_zero_init_with_a_stage0_config_is_a_no_op():
    with deepspeed.zero.Init(enabled=False, config_dict_or_path={"zero_optimization": {"stage": 0}}):
        layer = torch.nn.Linear(3, 2)
    assert layer.weight.shape == (2, 3) and not hasattr(layer.weight, "ds_id")


_RENDEZVOUS = """
import sys, torch.distributed as dist, trident as deepspeed
deepspeed.init_distributed(dist_backend="gloo", init_method=sys.argv[1], rank=int(sys.argv[2]), world_size=2)
t = __import__("torch").ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
assert dist.get_world_size() == 2 and t.item() == 3.0, t
dist.destroy_process_group()
"""


@pytest.mark.parametrize("kind", ["file", "tcp"])
def test_init_distributed_takes_file_and_tcp_init_methods(kind, tmp_path):
    """Two processes meet through init_method as torch.distributed takes it, not env://."""
    if kind == "file":
        url = f"file://{tmp_path / 'rendezvous'}"
    else:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            url = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                                          "MASTER_PORT", "LOCAL_RANK")}
    procs = [subprocess.Popen([sys.executable, "-c", _RENDEZVOUS, url, str(r)], env=env, stderr=subprocess.PIPE)
             for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err.decode()[-2000:]


def test_init_distributed_rejects_an_unknown_init_method():
    from trident.comm.backend import _init_from_url
    with pytest.raises(ValueError, match="init_method must be"):
        _init_from_url("gloo", "udp://x", 0, 1, 10.0)


_INIT_FROM_ENV = """
import torch, torch.distributed as dist, trident as deepspeed
assert not dist.is_initialized()
with deepspeed.zero.Init():
    layer = torch.nn.Linear(4, 2)
assert dist.is_initialized() and dist.get_world_size() == 1
dist.destroy_process_group()
"""


def test_zero_init_starts_torch_distributed_from_the_environment():
    """DeepSpeed's zero.Init() with RANK / WORLD_SIZE / MASTER_* set starts the group itself."""
    import os
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    done = subprocess.run([sys.executable, "-c", _INIT_FROM_ENV], env=env, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
