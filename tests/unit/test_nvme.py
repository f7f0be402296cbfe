"""NVMe swap plumbing: path checks, the per-run lock, clean-up at exit, the I/O pool and the
parameter swap files (no processes beyond one child for the exit test)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from trident.config import load_config
from trident.zero.nvme import AsyncFileIO, ParamSwapper, SwapDirectory, check_nvme_path

KEY = "zero_optimization.offload_optimizer.nvme_path"


def test_missing_path_names_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"offload_optimizer\.nvme_path .*does not exist"):
        check_nvme_path(str(tmp_path / "nope"), 1, KEY)


def test_file_is_not_a_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        check_nvme_path(str(f), 1, KEY)


def test_read_only_directory(tmp_path):
    """A directory of a pseudo file system refuses new files even to root; a chmod-ed one
    refuses them to anyone else."""
    with pytest.raises(ValueError, match="not writable"):
        check_nvme_path("/proc/self", 1, KEY)
    if os.geteuid() != 0:
        tmp_path.chmod(0o500)
        try:
            with pytest.raises(ValueError, match="not writable"):
                check_nvme_path(str(tmp_path), 1, KEY)
        finally:
            tmp_path.chmod(0o700)


def test_not_enough_free_space(tmp_path):
    with pytest.raises(ValueError, match="GiB free but this rank needs"):
        check_nvme_path(str(tmp_path), 1 << 60, KEY)
    assert check_nvme_path(str(tmp_path), 1 << 20, KEY) == str(tmp_path)


def test_nvme_without_path_and_wrong_stage_are_config_errors():
    with pytest.raises(Exception, match="nvme_path is not set"):
        load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
            "stage": 2, "offload_optimizer": {"device": "nvme"}}})
    with pytest.raises(Exception, match="offload_param needs stage >= 3"):
        load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
            "stage": 2, "offload_param": {"device": "cpu"}}})
    with pytest.raises(Exception, match="offload_optimizer needs stage >= 1"):
        load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
            "stage": 0, "offload_optimizer": {"device": "cpu"}}})


def test_second_run_on_the_same_path_is_refused(tmp_path):
    first = SwapDirectory(str(tmp_path), 0, KEY)
    with pytest.raises(RuntimeError, match=f"in use by another trident run \\(pid {os.getpid()}\\)"):
        SwapDirectory(str(tmp_path), 0, KEY)
    other_rank = SwapDirectory(str(tmp_path), 1, KEY)  # other ranks and kinds have their own lock
    other_rank.close()
    first.close()
    again = SwapDirectory(str(tmp_path), 0, KEY)  # released on close
    again.close()
    assert list(tmp_path.iterdir()) == []


def test_lock_refusal_across_processes(tmp_path):
    held = SwapDirectory(str(tmp_path), 0, KEY)
    code = ("import sys; from trident.zero.nvme import SwapDirectory\n"
            f"try:\n    SwapDirectory({str(tmp_path)!r}, 0, {KEY!r})\n"
            "except RuntimeError as e:\n    print(e); sys.exit(3)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    held.close()
    assert out.returncode == 3, out.stderr
    assert "give each concurrent run its own nvme_path" in out.stdout


def test_files_removed_at_interpreter_exit(tmp_path):
    code = ("import torch; from trident.zero.nvme import SwapDirectory, AsyncFileIO\n"
            f"d = SwapDirectory({str(tmp_path)!r}, 0, {KEY!r})\n"
            "AsyncFileIO().write(d.file('x.swp'), torch.ones(1000)).result()\n"
            "print(d.bytes_on_disk())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == 4000
    assert list(tmp_path.iterdir()) == []


def test_stale_directory_of_a_dead_run_is_taken_over(tmp_path):
    stale = tmp_path / "trident-rank0-offload_optimizer"
    stale.mkdir()
    (stale / "sub0.swp").write_bytes(b"old")
    d = SwapDirectory(str(tmp_path), 0, KEY)
    assert os.listdir(d.path) == []
    d.close()


@pytest.mark.parametrize("threads,block", [(1, 1 << 20), (3, 4096)])
def test_io_round_trip_in_pieces(tmp_path, threads, block):
    io = AsyncFileIO(threads, block)
    data = torch.randn(50_001, dtype=torch.float32)
    path = str(tmp_path / "t.swp")
    io.wait(io.write(path, data))
    back = torch.empty_like(data)
    io.wait(io.read(path, back))
    assert torch.equal(back, data)
    part = torch.empty(10, dtype=torch.float32)
    io.wait(io.read(path, part, offset=4 * 123))
    assert torch.equal(part, data[123:133])
    io.wait(io.write(path, torch.zeros(5), offset=4 * 7))
    io.wait(io.read(path, back))
    assert torch.equal(back[7:12], torch.zeros(5)) and torch.equal(back[12:], data[12:])
    assert io.bytes_written == 4 * (50_001 + 5)
    io.close()


def test_read_past_the_end_is_an_error(tmp_path):
    io = AsyncFileIO()
    path = str(tmp_path / "short.swp")
    io.wait(io.write(path, torch.ones(4)))
    with pytest.raises(EOFError, match="truncated or removed"):
        io.wait(io.read(path, torch.empty(8)))
    io.close()


def test_param_swapper_round_trip_bf16(tmp_path):
    key = "zero_optimization.offload_param.nvme_path"
    store = ParamSwapper(SwapDirectory(str(tmp_path), 0, key), AsyncFileIO(2, 4096), torch.bfloat16, 2)
    shards = {(0, u): torch.randn(100 + u).to(torch.bfloat16) for u in range(4)}
    for k, v in shards.items():
        store.create(k, v)
    assert store.prefetch((0, 0)) and store.prefetch((0, 1))
    assert not store.prefetch((0, 2))  # buffer_count reads in flight
    assert torch.equal(store.take((0, 1)), shards[(0, 1)])
    store.write_range((0, 2), 10, torch.full((5,), 3.0))
    got = store.take((0, 2))
    assert torch.equal(got[10:15], torch.full((5,), 3.0, dtype=torch.bfloat16))
    assert torch.equal(got[:10], shards[(0, 2)][:10])
    assert torch.equal(store.read_range((0, 3), 1, 4), shards[(0, 3)][1:4])
    assert store.bytes_on_disk() == 2 * sum(v.numel() for v in shards.values())
    store.close()
    assert list(tmp_path.iterdir()) == []
