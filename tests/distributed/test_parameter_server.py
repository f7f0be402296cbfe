"""Parameter servers on real gloo ranks: async staleness, lost workers, checkpoints, the launcher.

Sync-mode equivalence with serial training is in tests/parity/test_ps_equivalence.py. Tests that
kill or hang a rank run in their own freshly spawned processes (`_spawn_job`), never in the
shared `run_on_ranks` pools, which a dead rank would break for the tests after them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file

import trident
from trident.engine.engine import Engine
from trident.engine.strategy import GradientStrategy, RemoteStrategy
from trident.models.toy import TinyMLP, make_regression_data
from trident.parameter_server import format_updates, serve, staleness_violations
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.parity import assert_state_close

MICRO = 8
X, Y = make_regression_data(640, d_in=8, d_out=8, seed=3)
TRAIN, TEST = slice(0, 512), slice(512, 640)
SLOW_S = 0.02           # the slow worker's extra time per step
# Engine's user API that a training script touches; the worker engine must offer all of it.
ENGINE_API = ("forward", "backward", "step", "is_gradient_accumulation_boundary", "global_steps", "micro_steps",
              "global_samples", "get_lr", "dp_rank", "dp_world_size", "global_rank", "world_size", "last_loss",
              "save_checkpoint", "load_checkpoint", "train_batch_size", "train_micro_batch_size_per_gpu",
              "gradient_accumulation_steps", "get_global_grad_norm", "module", "training_dataloader", "train", "eval",
              "loss_scale", "memory_breakdown", "optimizer", "lr_scheduler", "consolidated_state_dict",
              "save_16bit_model")


def make_mlp() -> TinyMLP:
    torch.manual_seed(0)
    return TinyMLP(d_in=8, d_hidden=32, d_out=8, n_layers=3)


def held_out_loss(params: dict[str, torch.Tensor]) -> float:
    model = make_mlp()
    model.load_state_dict(params)
    with torch.no_grad():
        return F.mse_loss(model(X[TEST]), Y[TEST]).item()


def regression_config(servers: int, mode: str, k: int, timeout_s: float = 60.0, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 0,
            "optimizer": {"type": "Adam", "params": {"lr": 3e-3}},
            "zero_optimization": {"reduce_bucket_size": 500},
            "parameter_server": {"servers": servers, "mode": mode, "staleness": k},
            "distributed": {"timeout_s": timeout_s}, **extra}


def train_until(engine, budget: int, slow_s: float = 0.0, die_at: int = -1) -> None:
    """Train on random batches until the servers have applied `budget` updates."""
    g = torch.Generator().manual_seed(100 + engine.dp_rank)
    while engine.server_version < budget:
        if engine.global_steps == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        idx = torch.randint(0, TRAIN.stop, (MICRO,), generator=g)
        loss = engine(X[idx], Y[idx])
        engine.backward(loss)
        engine.step()
        if slow_s:
            time.sleep(slow_s)


def regression_run(servers: int, mode: str, k: int, budget: int) -> dict:
    """Every rank of a run_on_ranks pool; the last worker is slow."""
    mesh = cached_mesh()
    cfg = regression_config(servers, mode, k)
    if dist.get_rank() < servers:
        r = serve(cfg, make_mlp(), mesh=mesh)
        return {"role": "server", "records": r.records, "params": r.parameters, "steps": r.worker_steps}
    engine, _, _, _ = trident.initialize(model=make_mlp(), config=cfg, mesh=mesh)
    slow = engine.dp_rank == engine.dp_world_size - 1
    train_until(engine, budget, SLOW_S if slow else 0.0)
    engine.close()
    return {"role": "worker", "steps": engine.global_steps, "slow": slow}


def _merge_params(results) -> dict[str, torch.Tensor]:
    return {k: v for r in results if r["role"] == "server" for k, v in r["params"].items()}


@pytest.mark.parametrize("servers,workers,k", [(1, 3, 0), (2, 3, 2), (1, 3, 8)])
def test_async_staleness_bound_and_slow_worker(servers, workers, k):
    steps = 30                      # sync steps; async applies as many worker gradients
    sync = run_on_ranks(servers + workers, regression_run, servers, "sync", 0, steps)
    asyn = run_on_ranks(servers + workers, regression_run, servers, "async", k, steps * workers)
    records = [rec for r in asyn if r["role"] == "server" for rec in r["records"]]
    assert not staleness_violations(records, k), format_updates(staleness_violations(records, k))
    assert max(r.staleness for r in records) == k  # fast workers did run ahead, up to the bound
    table = format_updates(records)
    assert f"max staleness {k}" in table and "base_clock" in table
    steps_of = {r["slow"]: r["steps"] for r in asyn if r["role"] == "worker"}
    fast = [r["steps"] for r in asyn if r["role"] == "worker" and not r["slow"]]
    if k == 0:  # bulk-synchronous: nobody gets a step ahead
        assert max(fast) - steps_of[True] <= 1, (fast, steps_of[True])
    else:
        assert min(fast) > steps_of[True], (fast, steps_of[True])
    # Same number of worker gradients: async's test loss within 25% of sync's. Async takes 3x as
    # many (smaller-batch, slightly stale) Adam steps, so it usually ends lower; 25% covers runs
    # where the slow worker's stale gradients cost more.
    initial, sync_loss, async_loss = held_out_loss(dict(make_mlp().named_parameters())), held_out_loss(
        _merge_params(sync)), held_out_loss(_merge_params(asyn))
    assert sync_loss < 0.5 * initial
    assert async_loss < 1.25 * sync_loss, (initial, sync_loss, async_loss)


# -- lost workers, in fresh processes --------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, out: str, target, args: tuple) -> None:
    """One rank of a fresh job: runs target(rank, out, *args), saves what it returned or raised."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # A generous start-up timeout: the ranks import torch at different speeds on 2 cores. The
    # parameter servers keep their own time (distributed.timeout_s of the config).
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    result: dict = {}
    code = 0
    try:
        result = target(rank, out, *args) or {}
    except SystemExit as exc:
        code = int(exc.code or 0)
    except BaseException as exc:  # recorded for the test to inspect
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        code = 1
    result["end"] = time.time()
    Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))
    os._exit(code)  # skip interpreter teardown: some ranks' peers are dead


def _spawn_job(world: int, target, args: tuple, out: Path, wait_for: list[int], timeout: float):
    """Start `world` fresh ranks; wait up to `timeout` s for `wait_for`; kill the rest.
    Returns (exit codes, per-rank results)."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, str(out), target, args)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for r in wait_for:
        procs[r].join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    results = {r: pickle.loads(Path(out, f"{r}.pkl").read_bytes()) for r in range(world)
               if Path(out, f"{r}.pkl").exists()}
    return [p.exitcode for p in procs], results


def _async_kill_target(rank: int, out: str, budget: int) -> dict:
    cfg = regression_config(1, "async", 2, timeout_s=20)
    if rank == 0:
        r = serve(cfg, make_mlp())
        return {"lost": r.lost, "steps": r.worker_steps, "version": r.version, "params": r.parameters,
                "bound_ok": not staleness_violations(r.records, 2)}
    engine, _, _, _ = trident.initialize(model=make_mlp(), config=cfg)
    train_until(engine, budget, die_at=3 if engine.dp_rank == 1 else -1)
    engine.close()
    return {"steps": engine.global_steps}


def test_async_worker_killed_training_finishes(tmp_path):
    budget = 60
    codes, results = _spawn_job(4, _async_kill_target, (budget,), tmp_path, wait_for=[0, 1, 2, 3], timeout=90)
    assert codes[2] == -signal.SIGKILL  # worker 1 (global rank 2) was killed at its step 3
    assert [codes[i] for i in (0, 1, 3)] == [0, 0, 0], {r: v.get("error") for r, v in results.items()}
    server = results[0]
    assert list(server["lost"]) == [1] and "worker 1 (global rank 2) was lost" in server["lost"][1]
    assert "connection closed" in server["lost"][1]
    assert server["version"] >= budget and server["bound_ok"]
    assert server["steps"][1] == 3 and server["steps"][0] > 3 and server["steps"][2] > 3
    initial = held_out_loss(dict(make_mlp().named_parameters()))
    assert held_out_loss(server["params"]) < 0.5 * initial


def _sync_failure_target(rank: int, out: str, failure: str, timeout_s: float) -> dict:
    cfg = regression_config(1, "sync", 0, timeout_s=timeout_s)
    engine, _, _, _ = trident.initialize(model=make_mlp(), config=cfg)  # rank 0 serves, then exits
    for step in range(40):
        if engine.dp_rank == 1 and step == 3:
            Path(out, "failed_at").write_text(repr(time.time()))
            if failure == "killed":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(120)  # stuck: alive, but silent
        x, y = X[step * MICRO:(step + 1) * MICRO], Y[step * MICRO:(step + 1) * MICRO]
        engine.backward(engine(x, y))
        engine.step()
    engine.close()
    return {"steps": engine.global_steps}


@pytest.mark.parametrize("failure", ["killed", "stuck"])
def test_sync_lost_worker_stops_every_rank_within_timeout(tmp_path, failure):
    timeout_s = 3.0
    codes, results = _spawn_job(3, _sync_failure_target, (failure, timeout_s), tmp_path, wait_for=[0, 1],
                                timeout=60)
    failed_at = float(Path(tmp_path, "failed_at").read_text())
    reason = "its connection closed" if failure == "killed" else "it sent nothing for longer than"
    for rank in (0, 1):  # the server and the other worker
        assert codes[rank] == 1, (rank, codes, results.get(rank))
        error = results[rank]["error"]
        assert error.startswith("WorkerLostError") and "worker 1 (global rank 2) was lost" in error, error
        assert reason in error and "sync mode" in error
        # detection takes timeout_s at most after the last message, plus one watchdog tick; 1 s
        # covers the tick and the time to unwind
        assert results[rank]["end"] - failed_at < timeout_s + 1.0, (rank, results[rank]["end"] - failed_at)


# -- checkpoints -----------------------------------------------------------------------------

def _ckpt_config(servers: int) -> dict:
    return regression_config(servers, "sync", 0, optimizer={"type": "AdamW", "params": {"lr": 3e-3}},
                             scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": 3e-3,
                                                                       "warmup_num_steps": 6}})


def _steps(engine, first: int, last: int) -> None:
    for step in range(first, last):
        start = (step * engine.dp_world_size + engine.dp_rank) * MICRO
        engine.backward(engine(X[start:start + MICRO], Y[start:start + MICRO]))
        engine.step()


def ckpt_run(servers: int, folder: str, resume: bool) -> dict:
    """Train 8 steps, saving after 4; or (resume) load that checkpoint into a differently seeded
    model, possibly with a different number of servers, and train steps 4-8."""
    mesh = cached_mesh()
    cfg = _ckpt_config(servers)
    if not resume:  # periodic saves as well
        cfg["checkpoint"] = {"path": folder + "-periodic", "save_interval": 4}
    torch.manual_seed(7 if resume else 0)
    model = TinyMLP(d_in=8, d_hidden=32, d_out=8, n_layers=3)
    if dist.get_rank() < servers:
        return {"role": "server", "version": serve(cfg, model, mesh=mesh).version}
    engine, optimizer, _, schedule = trident.initialize(model=model, config=cfg, mesh=mesh)
    missing = [name for name in ENGINE_API if not hasattr(engine, name)]
    # the one Engine, over a strategy that implements both protocols
    one_engine = (type(engine) is Engine and isinstance(engine.strategy, GradientStrategy)
                  and isinstance(engine.strategy, RemoteStrategy))
    if resume:
        path, client = engine.load_checkpoint(folder)
        assert client == {"note": "four steps"} and path.endswith("global_step4"), (path, client)
        assert engine.global_steps == 4 and engine.micro_steps == 4
    else:
        assert engine.load_checkpoint(folder) == (None, None)  # nothing saved yet
        _steps(engine, 0, 4)
        engine.save_checkpoint(folder, client_state={"note": "four steps"})
    _steps(engine, 4, 8)
    lrs = (engine.get_lr(), optimizer.param_groups[0]["lr"], schedule.get_last_lr())
    engine.save_16bit_model(folder, f"final_{servers}.safetensors")
    weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    engine.close()
    return {"role": "worker", "weights": weights, "lrs": lrs, "missing": missing, "steps": engine.global_steps,
            "one_engine": one_engine}


def test_checkpoint_restores_server_state_into_another_layout(tmp_path):
    folder = str(tmp_path / "ckpt")
    first = run_on_ranks(4, ckpt_run, 2, folder, False)            # 2 servers + 2 workers
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step4"
    assert sorted(p.name for p in (tmp_path / "ckpt" / "global_step4").iterdir()) == [
        "ps_server_0.pt", "ps_server_1.pt", "ps_workers.pt"]
    periodic = tmp_path / "ckpt-periodic"
    assert (periodic / "latest").read_text() == "global_step8" and (periodic / "global_step4").is_dir()
    second = run_on_ranks(3, ckpt_run, 1, folder, True)            # 1 server + 2 workers
    a = [r for r in first if r["role"] == "worker"]
    b = [r for r in second if r["role"] == "worker"]
    assert a[0]["missing"] == [] and b[0]["missing"] == []
    assert all(r["one_engine"] for r in a + b)
    assert [r["version"] for r in first if r["role"] == "server"] == [8, 8]
    assert [r["version"] for r in second if r["role"] == "server"] == [8]
    assert_state_close(load_file(str(tmp_path / "ckpt" / "final_1.safetensors")), a[0]["weights"], rtol=1e-6)
    for x, y in zip(a, b):
        assert x["steps"] == y["steps"] == 8
        assert x["lrs"] == y["lrs"]
        # the same arithmetic in the same order: only the placement differs
        assert_state_close(y["weights"], x["weights"], rtol=1e-6)


# -- the launcher ----------------------------------------------------------------------------

SCRIPT = '''
import sys
import torch
import trident
from trident.models.toy import TinyMLP

fail_rank = int(sys.argv[1]) if len(sys.argv) > 1 else -1
config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 0,
          "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
          "parameter_server": {"servers": 1, "mode": "sync"}, "distributed": {"timeout_s": 60}}
torch.manual_seed(0)
engine, *_ = trident.initialize(model=TinyMLP(), config=config)  # rank 0 serves and exits 0 here
for step in range(3):
    if engine.global_rank == fail_rank and step == 1:
        raise RuntimeError(f"injected failure on rank {fail_rank}")
    g = torch.Generator().manual_seed(step * 10 + engine.dp_rank)
    x, y = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
    engine.backward(engine(x, y))
    engine.step()
weights = torch.cat([p.detach().flatten() for p in engine.module.parameters()])
print(f"RESULT rank={engine.global_rank} dp={engine.dp_rank} of={engine.dp_world_size} "
      f"steps={engine.global_steps} checksum={weights.sum().item():.6f} END", flush=True)
sys.exit(0)  # the worker tells the servers it is done at exit
'''


@pytest.mark.launch
def test_trident_launch_starts_servers_and_workers(tmp_path):
    script = tmp_path / "ps_train.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "trident.cli.main", "launch", "--nproc", "3", str(script)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {int(m.group(1)): m.group(0) for m in re.finditer(r"RESULT rank=(\d+) .*? END", proc.stdout)}
    assert sorted(rows) == [1, 2]  # rank 0 served
    fields = {r: dict(kv.split("=") for kv in row[len("RESULT "):-len(" END")].split()) for r, row in rows.items()}
    assert [fields[r]["dp"] for r in (1, 2)] == ["0", "1"] and fields[1]["of"] == "2"
    assert fields[1]["steps"] == "3" and fields[1]["checksum"] == fields[2]["checksum"]


def test_sync_worker_script_raising_stops_every_rank(tmp_path):
    """A worker whose script raises tells the servers on exit (FAILED); every rank stops, naming it."""
    script = tmp_path / "ps_train.py"
    script.write_text(SCRIPT)
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(script), "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "RANK": str(r), "WORLD_SIZE": "3", "LOCAL_RANK": str(r),
                                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                                              "OMP_NUM_THREADS": "1"})
             for r in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [1, 1, 1], [err[-2000:] for _, err in outs]
    assert "injected failure on rank 2" in outs[2][1]
    for _, err in outs[:2]:  # the server and the other worker
        assert "WorkerLostError" in err and "worker 1 (global rank 2) was lost: its training script raised" in err, \
            err[-2000:]
