"""`trident plan --calibrate`: measure this machine for the planner, in well under a minute.

Every rank of the world measures at once (`measure_rank`), so each sees what a training run's
rank sees: the other ranks loading the same cores, caches and memory bus, and the same thread
count. What is measured:

- GEMM seconds on a grid of (m, n, k) (`GEMM_GRID`), the fastest of several timed repeats;
- copy bandwidth (host transfers, offload) and the element-wise rate of a transformer layer's
  non-GEMM work (norms, bias adds, head copies, GELU, residual adds) forward and backward;
- the fused attention kernel's rate, forward and backward, at a few head widths;
- the fixed cost of one autograd op (forward + backward of a tiny tensor): per-layer costs;
- an AdamW step's cost per parameter and per tensor;
- alpha-beta of all_reduce, all_gather, reduce_scatter, broadcast, all_to_all and p2p on the
  backend at hand (gloo on CPU, NCCL on GPU), least squares over a few message sizes.

On a GPU (`device="cuda"`) the same code times with CUDA synchronisation, in bf16; it is
written for NCCL but has only run on CPU here.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist

from trident.planner.cluster import COLLECTIVES, Calibration, CollectiveFit
from trident.planner.gemm import GemmTable

GEMM_GRID = ((32, 64, 128, 256, 512, 1024),) * 3
"""(m, n, k) values measured, every combination (216 shapes, 2 GFLOP at most): steps of 2,
because a CPU's rate falls off a cliff where A, B and C outgrow its caches, and coarser steps
interpolate across the cliff. Larger shapes take the rate at the grid's edge."""
COMM_SIZES = (4 << 10, 256 << 10, 2 << 20, 8 << 20)
"""Message sizes (bytes) each collective is timed at for the alpha-beta fit."""
MIN_SAMPLE_SECONDS = 0.002
SAMPLES = 5


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, samples: int = SAMPLES, group=None) -> float:
    """Seconds of one `fn()` call: a warm-up, then the fastest of `samples` timings, each
    repeating fn enough times to last MIN_SAMPLE_SECONDS (timer resolution). The fastest,
    not the median: other processes only ever add time, and what is wanted is what the
    hardware does (on a loaded machine training steps will be slower than predicted). With `group` (fn is a collective)
    the ranks agree on the repeat count, or they would wait for each other forever."""
    fn()
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    one = max(time.perf_counter() - start, 1e-7)
    reps = max(1, int(MIN_SAMPLE_SECONDS / one))
    if group is not None:
        agreed = torch.tensor([reps], dtype=torch.int64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        reps = int(agreed.item())
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        _sync(device)
        times.append((time.perf_counter() - start) / reps)
    return min(times)


GEMM_PASSES = 2
"""Times the grid is swept; each shape keeps its fastest pass (a burst of load elsewhere,
which evicts the caches for a while, rarely hits the same shape twice)."""


def measure_gemm(device: torch.device, dtype: torch.dtype, group=None) -> GemmTable:
    """The GEMM grid; ranks step through it together (a barrier per shape) so that each shape is
    timed while the other ranks run the same one, as in training."""
    ms, ns, ks = GEMM_GRID
    best: dict[tuple[int, int, int], float] = {}
    for _ in range(GEMM_PASSES):
        for m in ms:
            for n in ns:
                for k in ks:
                    a = torch.randn(m, k, device=device, dtype=dtype)
                    b = torch.randn(k, n, device=device, dtype=dtype)
                    if group is not None:
                        dist.barrier(group=group)
                    t = _timed(lambda: torch.mm(a, b), device, samples=3)
                    best[(m, n, k)] = min(t, best.get((m, n, k), t))
    return GemmTable(ms, ns, ks, tuple((m, n, k, t) for (m, n, k), t in best.items()))


def measure_bandwidths(device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(copy bandwidth, element-wise rate) in bytes/s. The copy counts bytes read + written. The
    element-wise rate is a transformer layer's non-GEMM work run forward and backward through
    autograd (`_layer_elementwise`), divided by the bytes the planner counts for it: forward's
    (`time.elementwise_bytes_per_token`) and twice that for backward. Dividing by the planner's
    own count makes the rate absorb what a byte count leaves out (GELU's arithmetic on a CPU,
    gradient accumulation, bias-gradient sums)."""
    x = torch.randn(4 << 20, device=device, dtype=dtype)
    y = torch.empty_like(x)
    copy = 2 * x.numel() * x.element_size() / _timed(lambda: y.copy_(x), device)
    return copy, _elementwise_rate(device, dtype)


ELEMENTWISE_SHAPE = (8, 128, 256, 4)
"""(micro-batch, sequence, d_model, heads) of the layer whose element-wise work is timed."""


def _elementwise_rate(device: torch.device, dtype: torch.dtype) -> float:
    from trident.planner.layout import Layout, Workload
    from trident.planner.presets import ModelSpec
    from trident.planner.time import elementwise_bytes_per_token

    b, s, h, a = ELEMENTWISE_SHAPE
    step = _layer_elementwise(b, s, h, a, device, dtype)
    spec = ModelSpec("calibration", 1, h, a, 256, s)
    precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
    per_token = elementwise_bytes_per_token(spec, s, Layout(micro_batch=b),
                                            Workload(seq_len=s, global_batch=b, precision=precision))
    return 3 * b * s * per_token / _timed(step, device)


def _layer_elementwise(b: int, s: int, h: int, a: int, device: torch.device, dtype: torch.dtype):
    """One pre-norm GPT layer with its GEMMs taken out, forward and backward: the inputs stand
    for the GEMM outputs (qkv, attention, MLP in and out), each with its bias; the work left is
    the norms, bias adds, head split and merge copies, the activation, the residual adds and
    the gradients of all of them."""
    def leaf(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)

    x, qkv, attn, up, down = leaf(b, s, h), leaf(b, s, 3 * h), leaf(b, s, h), leaf(b, s, 4 * h), leaf(b, s, h)
    norm_w, norm_b, qkv_b, attn_b, up_b, down_b = leaf(h), leaf(h), leaf(3 * h), leaf(h), leaf(4 * h), leaf(h)
    d = h // a
    f = torch.nn.functional

    def step():
        n1 = f.layer_norm(x, (h,), norm_w, norm_b)
        heads = (qkv + qkv_b + n1.repeat(1, 1, 3)).view(b, s, 3, a, d).permute(2, 0, 3, 1, 4).contiguous()
        merged = heads[0].transpose(1, 2).reshape(b, s, h)
        r1 = x + (attn + merged) + attn_b
        n2 = f.layer_norm(r1, (h,), norm_w, norm_b)
        act = f.gelu(up + up_b)
        out = r1 + (down + down_b) + n2 + act[..., :h]
        out.sum().backward()

    return step


ATTENTION_HEAD_DIMS = (16, 32, 64, 128)
ATTENTION_SHAPE = (32, 128)
"""(batch x heads, sequence) of the causal attention timed at each head width."""


def measure_attention(device: torch.device, dtype: torch.dtype) -> tuple[tuple[int, float], ...]:
    """(head width, FLOP/s) of the fused causal attention kernel (`scaled_dot_product_attention`)
    forward and backward. FLOPs are counted as the planner counts them: the two GEMMs of the
    forward over the whole sequence (the causal mask not halving them), three times over for
    forward and backward. On a CPU the kernel runs at about half the GEMM rate, and narrow heads
    far slower; on a GPU near the GEMM rate."""
    bh, s = ATTENTION_SHAPE
    rates = []
    for d in ATTENTION_HEAD_DIMS:
        q, k, v = (torch.randn(1, bh, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

        def step():
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

        rates.append((d, 3 * 4.0 * bh * s * s * d / _timed(step, device)))
    return tuple(rates)


def measure_op_seconds(device: torch.device) -> float:
    """One tiny op's forward and backward through autograd: the per-op fixed cost."""
    x = torch.randn(8, device=device, requires_grad=True)
    ops = 64

    def chain():
        y = x
        for _ in range(ops):
            y = y * 1.0001
        y.sum().backward()

    return _timed(chain, device) / ops


def measure_optimizer(device: torch.device) -> tuple[float, float]:
    """(seconds per parameter, seconds per tensor) of an AdamW step, from a few large and many
    small tensors (t = a x tensors + b x parameters)."""
    def step_time(tensors: int, numel: int) -> float:
        params = [torch.nn.Parameter(torch.randn(numel, device=device)) for _ in range(tensors)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-3)
        return _timed(opt.step, device)

    big_t, big_n = 4, 1 << 19
    small_t, small_n = 256, 64
    t_big, t_small = step_time(big_t, big_n), step_time(small_t, small_n)
    per_param = max(1e-12, (t_big - t_small * big_t / small_t) / (big_t * big_n - small_t * small_n * big_t / small_t))
    per_tensor = max(0.0, (t_small - per_param * small_t * small_n) / small_t)
    return per_param, per_tensor


def _collective_call(op: str, size: int, device: torch.device, group, rank: int, world: int):
    """A zero-argument callable running one `op` of `size` bytes (the op's full buffer)."""
    n = max(world, size // 4 // world * world)
    full = torch.zeros(n, device=device)
    shard = torch.zeros(n // world, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if op == "all_gather":  # torch >= 2.13 names these *_single; older ones *_into_tensor / *_tensor
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(full, shard, group=group)
    if op == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(shard, full, group=group)
    if op == "broadcast":
        return lambda: dist.broadcast(full, src=0, group=group)
    if op == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full, group=group)
    peer = 1 - rank if rank < 2 else None  # p2p: ranks 0 and 1 ping-pong; one message is half a round trip

    def ping():
        if peer is None:
            return
        if rank == 0:
            dist.send(full, peer, group=group)
            dist.recv(full, peer, group=group)
        else:
            dist.recv(full, peer, group=group)
            dist.send(full, peer, group=group)
    return ping


IN_STEP_OPS = ("all_reduce", "p2p")
"""Collectives timed one at a time after compute on CPU ranks: the all-reduce, which tensor
parallelism issues between layers and stage 0 once per step, each after its own compute, and
the pipeline's sends and receives, each after a micro-batch's compute on one stage. ZeRO-3's
gathers and reduce-scatters run back to back on gloo's thread (prefetch, buckets), as the
tight loop times them."""
IN_STEP_ALSO = ("reduce_scatter", "all_gather")
"""Timed both ways on CPU ranks: back to back (ZeRO-3's prefetched gathers, its buckets) under
their own names, and one at a time after compute under `<op>.in_step` (ZeRO-1/2's one
reduce-scatter and one all-gather per step)."""
IN_STEP_SAMPLES = 15
SCRATCH_BYTES = 16 << 20
"""Bytes of host memory touched before each timed collective: more than the caches hold."""


def _timed_in_step(fn, device: torch.device) -> float:
    """Seconds of one collective as a training step meets it: after compute that has pushed
    its buffers out of the caches and let the communication threads go idle, one call at a
    time, the mean of IN_STEP_SAMPLES. A tight loop of back-to-back calls (`_timed`) keeps
    buffers hot and threads spinning, and on gloo over a CPU it ran 5-6x faster than the same
    all-reduce between the layers of a tensor-parallel step. Every rank runs the same compute
    before each call, as the layers of a step do, so the time includes the small wait for the
    slower rank that every collective of a step pays too. That wait is bimodal (the ranks
    arrive together, or one is a compute burst behind): the median flips between the modes
    from one calibration to the next (0.5 or 3.3 ms for the same 4 KB all-reduce here), the
    mean over many calls is what a step of many collectives pays, and is stable."""
    scratch = torch.zeros(SCRATCH_BYTES // 4, device=device)
    a = torch.randn(512, 512, device=device)
    fn()
    times = []
    for _ in range(IN_STEP_SAMPLES):
        scratch.add_(1.0)
        torch.mm(a, a)  # a layer's worth of compute: each rank's own pace, as between tp collectives
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.fmean(times)


def fit_alpha_beta(sizes, seconds) -> tuple[float, float]:
    """t = alpha + beta x size by least squares on the relative error (weights 1 / t^2), both
    kept >= 0. Plain least squares is ruled by the largest message and leaves alpha to chance
    (0 to 375 us for the same gloo all-gather in three calibrations here); weighting each size
    by its own time lets the small messages, which are all latency, set it."""
    w = [1.0 / max(t, 1e-12) ** 2 for t in seconds]
    sw = sum(w)
    mean_s = sum(wi * s for wi, s in zip(w, sizes)) / sw
    mean_t = sum(wi * t for wi, t in zip(w, seconds)) / sw
    var = sum(wi * (s - mean_s) ** 2 for wi, s in zip(w, sizes))
    beta = max(0.0, sum(wi * (s - mean_s) * (t - mean_t) for wi, s, t in zip(w, sizes, seconds)) / var) if var else 0.0
    alpha = max(0.0, mean_t - beta * mean_s)
    if beta == 0.0:
        beta = 1e-12
    return alpha, beta


def measure_collectives(device: torch.device, group, rank: int, world: int) -> dict[str, CollectiveFit]:
    """Every collective's fit, keyed as `CollectiveFit`s are looked up: the op's name, and on a CPU
    also `<op>.in_step` for the ops of IN_STEP_ALSO."""
    cpu = device.type == "cpu"
    plan = [(op, op, cpu and op in IN_STEP_OPS) for op in COLLECTIVES]
    plan += [(f"{op}.in_step", op, True) for op in (IN_STEP_ALSO if cpu else ())]
    fits = {}
    for key, op, in_step in plan:
        times = []
        for size in COMM_SIZES:
            call = _collective_call(op, size, device, group, rank, world)
            dist.barrier(group=group)
            t = _timed_in_step(call, device) if in_step else _timed(call, device, group=group)
            times.append(t / 2 if op == "p2p" else t)
        try:
            alpha, beta = fit_alpha_beta(COMM_SIZES, times)
        except ZeroDivisionError:
            continue
        fits[key] = CollectiveFit(alpha, beta, world)
    return fits


def measure_rank(device: str | torch.device = "cpu", group=None, threads: int | None = None) -> dict:
    """Everything, measured on this rank while the others do the same; JSON-ready."""
    device = torch.device(device)
    if threads is not None and device.type == "cpu":
        torch.set_num_threads(threads)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else (0, 1)
    gemm = measure_gemm(device, dtype, group if world > 1 else None)
    copy, elementwise = measure_bandwidths(device, dtype)
    attention = measure_attention(device, dtype)
    op = measure_op_seconds(device)
    per_param, per_tensor = measure_optimizer(device)
    fits = measure_collectives(device, group, rank, world) if world > 1 else {}
    return Calibration(device.type, dist.get_backend(group) if world > 1 else "none", world,
                       torch.get_num_threads(), str(dtype).removeprefix("torch."), gemm, copy, elementwise, op,
                       per_param, per_tensor, fits, _memory_bytes(device), platform.node(),
                       datetime.now(timezone.utc).isoformat(timespec="seconds"), torch.__version__,
                       attention).to_json()


def _memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned_rank(rank: int, world: int, port: int, threads: int, out_dir: str) -> None:
    """One calibration rank: start its process group, measure, write rank<N>.json."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        data = measure_rank(device, dist.group.WORLD, threads)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(data))
    finally:
        dist.destroy_process_group()


def calibrate(world_size: int | None = None, threads: int | None = None) -> Calibration:
    """Spawn `world_size` ranks (default: the GPUs, or 2 on a CPU), measure, return rank 0's view.

    On a CPU each rank gets `threads` threads (default: the cores divided by the ranks, as
    `trident launch` gives a training run's ranks)."""
    cuda = torch.cuda.is_available()
    world = world_size or (torch.cuda.device_count() if cuda else 2)
    threads = threads or max(1, (os.cpu_count() or 1) // world)
    with tempfile.TemporaryDirectory() as out:
        torch.multiprocessing.spawn(_spawned_rank, args=(world, _free_port(), threads, out), nprocs=world, join=True)
        return Calibration.from_json(json.loads(Path(out, "rank0.json").read_text()), "calibration")


__all__ = ["GEMM_GRID", "calibrate", "fit_alpha_beta", "measure_gemm", "measure_rank"]
