"""Pieces every bench script shares: rank start-up, the data, the model, the timed step loop.

Kept apart so that the benchmarks time exactly the same loop (a barrier before each step, so the
slowest rank sets the pace; page faults counted over the timed steps only) and feed the same
token batches to every system they compare.
"""

from __future__ import annotations

import itertools
import os
import queue
import resource
import socket
import statistics
import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# The demo GPT (trident/configs/demo.json's "demo" preset with the bundled tokenizer's 4096-token
# vocabulary; 4.24M parameters, tied embeddings), the reference model of most benchmarks here.
DEMO_GPT = dict(vocab_size=4096, seq_len=128, n_layer=4, n_head=4, d_model=256)
# Issue 24's shape: 3.7M parameters (untied embeddings, vocabulary 1024), global batch 16.
GPT_3_7M = dict(vocab_size=1024, seq_len=128, n_layer=4, n_head=4, d_model=256, tie_embeddings=False)


def free_port() -> int:
    """A TCP port that was free a moment ago, for MASTER_PORT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_rank(rank: int, world: int, port: int) -> None:
    """torchrun's environment for one rank on this host, one compute thread per rank."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)


def token_batches(rank: int, model: dict, micro: int) -> Iterator[torch.Tensor]:
    """Endless [micro, seq_len + 1] token batches, seeded by rank so every system sees the same."""
    g = torch.Generator().manual_seed(rank)
    while True:
        yield torch.randint(0, model["vocab_size"], (micro, model["seq_len"] + 1), generator=g)


def build_gpt(model: dict) -> torch.nn.Module:
    """The reference GPT with seed 0, so every system starts from the same weights."""
    from trident.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(**model, dropout=0.0))


def timed_steps(step: Callable[[torch.Tensor], None], batches: Iterator[torch.Tensor],
                warmup: int, steps: int) -> tuple[float, float]:
    """Run warmup + steps training steps; median seconds and minor page faults per timed step."""
    times = []
    faults = 0
    for i, batch in enumerate(itertools.islice(batches, warmup + steps)):
        if i == warmup:
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        dist.barrier()
        start = time.perf_counter()
        step(batch)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return statistics.median(times), faults / steps


def peak_rss_bytes() -> int:
    """This process's peak resident set (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rotated(systems: Sequence[str], repeat: int) -> list[str]:
    """The systems in the order of one repeat: shifted by one each repeat, so no order bias."""
    k = repeat % len(systems)
    return list(systems[k:]) + list(systems[:k])


def run_ranks(target: Callable, world: int, args: tuple, what: str) -> list:
    """Start `world` fresh spawned processes `target(rank, port, *args, out)` and return what each
    puts on `out`; a rank that dies stops the others and raises, naming `what`."""
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=target, args=(r, port, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = []
    while len(results) < world:
        try:
            results.append(out.get(timeout=2))
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise RuntimeError(f"a worker failed ({what}); its traceback is above")
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"a worker exited with {p.exitcode} ({what})")
    return results
