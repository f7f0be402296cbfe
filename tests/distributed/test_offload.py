"""ZeRO-Offload / ZeRO-Infinity beyond the loss curves: checkpoints through NVMe swap files,
start-up errors, the per-run lock, and the memory that actually leaves the process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap


import trident
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.parity import assert_losses_close, assert_state_close
from tests.parity.test_dp_equivalence import LR, make_model, mean_losses
from tests.distributed.test_zero import resume_and_train


def nvme_config(path: str, micro: int, stage: int = 3, param: str = "nvme") -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_clipping": 0.05, "steps_per_print": 0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {
                "stage": stage, "reduce_bucket_size": 3000, "sub_group_size": 2000,
                "stage3_param_persistence_threshold": 100,
                "offload_optimizer": {"device": "nvme", "nvme_path": path, "pipeline_read": True,
                                      "pipeline_write": True},
                "offload_param": {"device": param, "nvme_path": path}}}


def train_and_checkpoint(swap: str, root: str, steps: int, save_at: int | None, resume: bool):
    mesh = cached_mesh()
    micro = 8 // mesh.dp_size
    engine, *_ = trident.initialize(model=make_model(), config=nvme_config(swap, micro), mesh=mesh)
    try:
        losses = resume_and_train(engine, mesh, micro, root, steps, save_at, resume)
        return losses, {k: v.float() for k, v in engine.consolidated_state_dict().items()}
    finally:
        engine.reducer.close()


def test_nvme_checkpoint_resume_is_identical(tmp_path):
    swap, root = str(tmp_path / "swap"), str(tmp_path / "ckpt")
    os.makedirs(swap)
    full = run_on_ranks(2, train_and_checkpoint, swap, root, 8, 4, False)
    again = run_on_ranks(2, train_and_checkpoint, swap, root, 8, None, True)
    assert len(again[0][0]) == 4
    assert_losses_close(mean_losses(again), mean_losses(full)[4:], rtol=1e-6)
    for (_, resumed), (_, whole) in zip(again, full):
        assert_state_close(resumed, whole, rtol=1e-6)
    assert os.listdir(swap) == []


def build_twice(swap: str):
    mesh = cached_mesh()
    cfg = nvme_config(swap, 2, stage=2, param="none")
    first, *_ = trident.initialize(model=make_model(), config=cfg, mesh=mesh)
    try:
        trident.initialize(model=make_model(), config=cfg, mesh=mesh)
    except RuntimeError as e:
        refused = str(e)
    else:
        refused = ""
    first.destroy()  # DeepSpeed's name: releases the swap directory
    second, *_ = trident.initialize(model=make_model(), config=cfg, mesh=mesh)  # free again after close
    second.close()
    return refused


def test_second_engine_on_the_same_nvme_path_is_refused(tmp_path):
    for refused in run_on_ranks(2, build_twice, str(tmp_path)):
        assert "offload_optimizer.nvme_path" in refused and "in use by another trident run" in refused
    assert list(tmp_path.iterdir()) == []


def build_bad(path: str):
    try:
        trident.initialize(model=make_model(), config=nvme_config(path, 4), mesh=cached_mesh())
    except ValueError as e:
        return str(e)
    return ""


def test_bad_nvme_path_fails_before_training(tmp_path):
    for message in run_on_ranks(2, build_bad, str(tmp_path / "missing")):
        assert "zero_optimization.offload_optimizer.nvme_path" in message and "does not exist" in message


# ---- memory --------------------------------------------------------------------------------

_MEASURE = textwrap.dedent("""
    import ctypes, json, os, sys, torch
    libc = ctypes.CDLL("libc.so.6")
    # Blocks of 64 KiB and up get their own mappings, returned on free: RSS then follows the
    # live tensors instead of glibc's heap fragmentation, which differs from run to run.
    libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 1 << 16)  # M_TRIM_THRESHOLD
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import trident
    from trident.models.gpt import GPT, GPTConfig
    cfg = json.loads(sys.argv[1])
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    model = GPT(GPTConfig(vocab_size=256, seq_len=8, n_layer=6, n_head=4, d_model=640, dropout=0.0, bias=False))
    torch.set_default_dtype(torch.float32)
    open("/proc/self/clear_refs", "w").write("5")  # peak RSS from here: start-up and two steps
    engine, *_ = trident.initialize(model=model, config=cfg)
    data = torch.randint(0, 256, (2, 9))
    for _ in range(2):
        engine.backward(engine(data[:, :-1], data[:, 1:]))
        engine.step()
    placed = engine.reducer.placement_bytes()
    hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
    engine.reducer.close()
    print(json.dumps({"peak": hwm, "placed": placed, "numel": engine.reducer.numel}))
""")


def _peak_rss(cfg: dict) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _MEASURE, json.dumps(cfg)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_peak_rss_drops_by_the_bytes_sent_to_nvme(tmp_path):
    zero = {"stage": 3, "sub_group_size": 250_000, "reduce_bucket_size": 1_000_000,
            "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 1_000_000,
            "stage3_max_live_parameters": 4_000_000}
    base = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "host_allocator": {"enabled": False}}
    plain = _peak_rss({**base, "zero_optimization": zero})
    offloaded = _peak_rss({**base, "zero_optimization": {
        **zero, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "pipeline_read": True,
                                      "pipeline_write": True, "buffer_count": 2},
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 2}}})
    on_disk = offloaded["placed"]["nvme"]
    assert on_disk >= 13 * offloaded["numel"]  # bf16 shards + fp32 masters + two Adam moments
    drop = plain["peak"] - offloaded["peak"]
    print(f"peak RSS {plain['peak'] / 2**20:.0f} MiB -> {offloaded['peak'] / 2**20:.0f} MiB with "
          f"{on_disk / 2**20:.0f} MiB on NVMe: drop = {drop / on_disk:.2f} x the bytes on disk")
    assert drop >= 0.8 * on_disk, (plain, offloaded)
