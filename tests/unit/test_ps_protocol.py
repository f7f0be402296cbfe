"""Parameter-server messages, records, config checks and shard state: no processes needed."""

from __future__ import annotations

import pytest
import torch

from trident.config import load_config
from trident.models.toy import TinyMLP
from trident.parameter_server import checkpoint as ckpt
from trident.parameter_server.layout import check_supported, param_groups
from trident.parameter_server.protocol import (Header, Kind, Reason, Tags, UpdateRecord, format_updates,
                                               header_buffer, lost_message, staleness_violations)
from trident.parameter_server.remote import RemoteOptimizer, RemoteSchedule
from trident.parameter_server.shard import ShardState
from trident.parameter_server.sharding import assign_servers, shard_layouts
from trident.parameter_server.start import shard_optimizer, shard_schedule


def test_header_round_trip_is_exact():
    h = Header(Kind.PUSH, step=12, version=345, clock=10, need=11, value=0.123456789012, count=2 ** 52 - 1,
               lrs=(1e-3, 2.5e-4))
    back = Header.decode(h.encode(header_buffer(2)))
    assert back == h


def test_tags_are_distinct_per_stream_and_session():
    a, b = Tags(1), Tags(2)
    streams = [getattr(a, n) for n in Tags.STREAMS] + [getattr(b, n) for n in Tags.STREAMS]
    assert len(set(streams)) == 12
    with pytest.raises(ValueError, match="session must be in"):
        Tags(0)


def test_records_staleness_and_table():
    records = [UpdateRecord(0, 0, step=5, base_version=9, base_clock=3, version=12, clock=4),
               UpdateRecord(0, 1, step=4, base_version=10, base_clock=4, version=13, clock=4)]
    assert [r.staleness for r in records] == [2, 0] and [r.delay for r in records] == [3, 3]
    assert staleness_violations(records, 2) == [] and staleness_violations(records, 1) == records[:1]
    table = format_updates(records)
    assert table.splitlines()[0].split() == ["server", "worker", "step", "base_version", "base_clock", "version",
                                             "clock", "staleness", "delay"]
    assert "worker 0: 1 updates, max staleness 2, mean delay 3.00" in table
    assert "... 2 more" in format_updates(records, limit=0)


def test_lost_messages_name_the_rank_and_reason():
    assert lost_message(1, 3, Reason.CONNECTION, "x") == (
        "worker 1 (global rank 3) was lost: its connection closed (the process died, or gave up waiting and "
        "closed it) [x]")
    assert lost_message(0, 0, Reason.SERVER).startswith("parameter server 0 (global rank 0) was lost")


def _cfg(**extra):
    return load_config({"train_micro_batch_size_per_gpu": 2, "parameter_server": {"servers": 1}, **extra})


def test_unsupported_combinations_are_named():
    check_supported(_cfg())
    check_supported(_cfg(fp16={"enabled": True}))  # fp16 under sync servers: they skip overflows for all
    with pytest.raises(ValueError) as err:
        check_supported(_cfg(zero_optimization={"stage": 2}, parameter_server={"servers": 1, "staleness": 3}))
    text = str(err.value)
    assert "zero_optimization.stage is 2" in text
    assert "parameter_server.staleness = 3 only applies to mode \"async\"" in text
    with pytest.raises(ValueError, match="fp16.enabled is true with parameter_server.mode \"async\""):
        check_supported(_cfg(fp16={"enabled": True}, parameter_server={"servers": 1, "mode": "async", "staleness": 1}))


def test_param_groups_by_name():
    model = TinyMLP(d_in=4, d_hidden=8, d_out=4, n_layers=2)
    assert param_groups(model, None, None) == [({}, [n for n, _ in model.named_parameters()])]
    w = [p for n, p in model.named_parameters() if n.endswith("weight")]
    b = [p for n, p in model.named_parameters() if n.endswith("bias")]
    groups = param_groups(model, None, [{"params": w, "weight_decay": 0.1}, {"params": b, "weight_decay": 0.0}])
    assert groups[0] == ({"weight_decay": 0.1}, ["layers.0.weight", "layers.1.weight"])
    with pytest.raises(ValueError, match="'layers.0.bias' requires grad but is in no optimizer parameter group"):
        param_groups(model, None, [{"params": w}])
    with pytest.raises(ValueError, match="not a trainable parameter of the model"):
        param_groups(model, None, [torch.nn.Parameter(torch.zeros(3))])


def _shards(model, servers, groups, cfg, optimizer=None):
    named = dict(model.named_parameters())
    names = list(named)
    owner = assign_servers([p.numel() for p in named.values()], servers, "round_robin")
    layouts = shard_layouts([p.shape for p in named.values()], owner, servers, 50)
    return [ShardState(sl, [names[i] for i in sl.tensors], [named[names[i]].detach() for i in sl.tensors],
                       lambda by_name: shard_optimizer(cfg, optimizer, groups, by_name),
                       lambda opt: shard_schedule(cfg, None, opt)) for sl in layouts]


def test_shard_optimizer_keeps_group_indices_and_hyperparameters():
    model = TinyMLP(d_in=4, d_hidden=8, d_out=4, n_layers=2)
    user = torch.optim.AdamW([{"params": [model.layers[0].weight], "lr": 0.5},
                              {"params": [p for n, p in model.named_parameters() if n != "layers.0.weight"]}],
                             lr=0.1, betas=(0.8, 0.9))
    groups = param_groups(model, user, None)
    shards = _shards(model, 2, groups, _cfg(), optimizer=user)
    for shard in shards:
        opt = shard.optimizer
        assert type(opt) is torch.optim.AdamW and len(opt.param_groups) == 2
        assert [g["lr"] for g in opt.param_groups] == [0.5, 0.1] and opt.param_groups[1]["betas"] == (0.8, 0.9)
    assert sum(len(g["params"]) for s in shards for g in s.optimizer.param_groups) == 4
    with pytest.raises(TypeError, match="must be a callable taking the optimizer"):
        shard_schedule(_cfg(), torch.optim.lr_scheduler.StepLR(user, 1), user)


def test_server_checkpoint_loads_into_another_number_of_servers(tmp_path):
    cfg = _cfg(optimizer={"type": "Adam", "params": {"lr": 0.01}},
               scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 10}})
    torch.manual_seed(0)
    model = TinyMLP(d_in=4, d_hidden=8, d_out=4, n_layers=3)
    groups = param_groups(model, None, None)
    two = _shards(model, 2, groups, cfg)
    for shard in two:
        for _ in range(3):
            shard.grad.normal_()
            shard.step()
        shard.clock = 3
        ckpt.write_shard(tmp_path, shard.layout.server, shard.state_dict(shard.layout.server, 2))
    torch.manual_seed(1)
    one, = _shards(TinyMLP(d_in=4, d_hidden=8, d_out=4, n_layers=3), 1, groups, cfg)
    ckpt.load_shard(one, tmp_path, 0, ckpt.LOAD_OPTIMIZER | ckpt.LOAD_SCHEDULER)
    assert (one.version, one.clock) == (3, 3) and one.lrs() == two[0].lrs()
    for shard in two:
        for name, p in shard.by_name.items():
            assert torch.equal(one.by_name[name], p)
            saved, loaded = shard.optimizer.state[p], one.optimizer.state[one.by_name[name]]
            assert torch.equal(saved["exp_avg_sq"], loaded["exp_avg_sq"]) and int(saved["step"]) == 3
    (tmp_path / "ps_server_1.pt").unlink()
    with pytest.raises(ValueError, match="holds 1 server files but was written by 2 servers"):
        ckpt.read_shards(tmp_path)


class _Engine:
    def get_lr(self):
        return [0.25]


def test_worker_views_of_optimizer_and_schedule():
    opt, sched = RemoteOptimizer(_Engine()), RemoteSchedule(_Engine())
    assert opt.param_groups == [{"lr": 0.25}] and sched.get_last_lr() == [0.25]
    with pytest.raises(RuntimeError, match="runs on the parameter servers"):
        opt.step()
    with pytest.raises(RuntimeError, match="lr_scheduler.step\\(\\) on a worker"):
        sched.step()


def test_every_strategy_has_the_protocol_methods():
    """The engine calls these on any strategy; a parameter-server worker's adds RemoteStrategy's."""
    from trident.data_parallel.replicated import ReplicatedOptimizer
    from trident.engine.strategy import GradientStrategy, RemoteStrategy
    from trident.parameter_server import PushPullStrategy
    from trident.zero.optimizer import ZeroOptimizer

    def methods(protocol) -> set[str]:
        return {n for n, v in vars(protocol).items() if not n.startswith("_") and callable(v)}

    for cls in (ReplicatedOptimizer, ZeroOptimizer, PushPullStrategy):
        assert sorted(n for n in methods(GradientStrategy) if not hasattr(cls, n)) == [], cls.__name__
    assert sorted(n for n in methods(RemoteStrategy) | {"server_version"} if not hasattr(PushPullStrategy, n)) == []
    assert not any(hasattr(cls, n) for cls in (ReplicatedOptimizer, ZeroOptimizer) for n in methods(RemoteStrategy))


def test_the_engine_assembles_parameter_server_runs():
    """`trident.parameter_server.initialize_parameter_server` stays public without the package
    importing the engine: the engine's run assembly registers itself there on import."""
    from trident.engine import parameter_server_run
    from trident.parameter_server import start

    assert start._run_assembly is parameter_server_run.initialize_parameter_server
