"""The GPU check's CUDA-only bodies: offload copies, comm/backward overlap, memory, planned step time.

Each body skips itself (an `Outcome` with status SKIP) on a CPU device: what it measures (pinned
host memory, CUDA events, the CUDA caching allocator, a GPU's planner preset) does not exist
there. Everything else in them is the same code on both devices.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trident.engine.build import initialize
from trident.models.gpt import GPTConfig
from trident.planner.peak import gpu_preset_name
from trident.tools.gpu_common import (MICRO, PASS, SKIP, STEPS, Outcome, compare, elapsed_seconds, engine_config,
                                      exact_fp32, make_gpt, median, needs_cuda, rank_rows, serial_run, tokens)

# -- pinned-memory offload with non-blocking copies -------------------------------------------


def offload(device: torch.device) -> Outcome:
    """ZeRO-2 with offload_optimizer {device: cpu, pin_memory: true}: same training as one process,
    fp32 masters in pinned host memory, and the profiler's host<->device copies from pinned memory
    (a copy from pageable memory cannot be asynchronous, whatever non_blocking says)."""
    skip = needs_cuda(device, "pinned host memory")
    if skip:
        return skip
    exact_fp32(device)
    config = engine_config(MICRO, zero_optimization={"stage": 2, "reduce_bucket_size": 4096,
                                                     "offload_optimizer": {"device": "cpu", "pin_memory": True}})
    engine, *_ = initialize(model=make_gpt(device), config=config)
    mesh = engine.mesh
    global_batch = MICRO * mesh.dp_size
    data = tokens(global_batch).to(device)
    norms = []
    for step in range(STEPS - 1):
        rows = rank_rows(data, step, global_batch, mesh.dp_rank, mesh.dp_size)
        engine.backward(engine(rows[:, :-1], rows[:, 1:]))
        engine.step()
        norms.append(engine.get_global_grad_norm())
    rows = rank_rows(data, STEPS - 1, global_batch, mesh.dp_rank, mesh.dp_size)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        engine.backward(engine(rows[:, :-1], rows[:, 1:]))
        engine.step()
        torch.cuda.synchronize()
    norms.append(engine.get_global_grad_norm())
    copies = [e.name for e in prof.events() if "Memcpy" in e.name and ("HtoD" in e.name or "DtoH" in e.name)]
    masters = [p for g in engine.optimizer.param_groups for p in g["params"]]
    pinned = sum(p.is_pinned() for p in masters)
    pinned_copies = {d: sum(d in c and "Pinned" in c for c in copies) for d in ("DtoH", "HtoD")}
    ref = serial_run(device, global_batch)
    result = compare(device, {k: v.detach() for k, v in engine.module.state_dict().items()}, ref.weights,
                     norms, ref.norms, f"zero=2 offload dp={mesh.dp_size}")
    # gradients go down and updated weights come back through pinned buffers; the few pageable
    # copies left are scalars (the loss, the gradient norm) read by .item()
    # (no copy at all means the profiler sees no GPU activity here, e.g. without CUPTI: not a failure)
    ok = result.status == PASS and pinned == len(masters) and (all(pinned_copies.values()) or not copies)
    seen = (f"pinned copies in the last step: {pinned_copies['DtoH']} device->host, {pinned_copies['HtoD']} "
            f"host->device (of {len(copies)} copies)" if copies else "the profiler saw no copies (no CUPTI?)")
    return Outcome.judge(ok, f"{pinned} of {len(masters)} fp32 masters pinned, {seen}; {result.detail}")


# -- communication overlapping backward ------------------------------------------------------

OVERLAP_SHAPE = GPTConfig(vocab_size=8192, seq_len=256, n_layer=6, n_head=8, d_model=512, bias=False)
OVERLAP_BUCKETS = 8
MIN_OVERLAP = 0.25
"""The share of the gradient all-reduce that must hide behind backward. The last bucket (the
embeddings) only becomes ready as backward ends, so with 8 buckets at most about 7/8 can hide."""


def overlap(device: torch.device) -> Outcome:
    """Stage-0 data parallelism: backward with the reduction against backward without it and the
    reduction alone, all timed with CUDA events on the compute stream. NCCL runs the buckets'
    all-reduces on its own stream, so the time they add to backward is less than their own."""
    skip = needs_cuda(device, "CUDA events")
    if skip:
        return skip
    model = make_gpt(device, OVERLAP_SHAPE)
    numel = sum(p.numel() for p in model.parameters())
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 0,
              "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 0, "overlap_comm": True, "reduce_bucket_size": numel // OVERLAP_BUCKETS}}
    engine, *_ = initialize(model=model, config=config)
    data = tokens(4, OVERLAP_SHAPE, steps=1).to(device)
    quiet, loud = [], []
    for window in range(7):  # two warm-up windows, then five measured
        for times in (quiet, loud):  # micro-step 1 reduces nothing, micro-step 2 all-reduces
            loss = engine(data[:, :-1], data[:, 1:])
            seconds = elapsed_seconds(lambda: engine.backward(loss), device)
            engine.step()
            if window >= 2:
                times.append(seconds)
    comm = _bucketed_all_reduce_seconds(device, numel, OVERLAP_BUCKETS)
    quiet_s, loud_s = median(quiet), median(loud)
    hidden = max(0.0, min(1.0, (quiet_s + comm - loud_s) / comm))
    return Outcome.judge(hidden >= MIN_OVERLAP,
                         f"{100 * hidden:.0f}% of a {comm * 1e3:.2f} ms all-reduce hidden behind a "
                         f"{quiet_s * 1e3:.2f} ms backward (backward with it: {loud_s * 1e3:.2f} ms; bar "
                         f"{100 * MIN_OVERLAP:.0f}%)")


def _bucketed_all_reduce_seconds(device: torch.device, numel: int, buckets: int) -> float:
    """Median GPU time of all-reducing `numel` fp32 values in `buckets` pieces, nothing else running."""
    flat = torch.ones(numel, device=device)
    pieces = flat.chunk(buckets)

    def reduce_all() -> None:
        for work in [dist.all_reduce(p, async_op=True) for p in pieces]:
            work.wait()

    reduce_all()
    return median([elapsed_seconds(reduce_all, device) for _ in range(5)])


# -- memory_breakdown() against the CUDA allocator -------------------------------------------

MEMORY_SHAPE = GPTConfig(vocab_size=1024, seq_len=128, n_layer=4, n_head=4, d_model=256)
MEMORY_RTOL = 0.10
"""After a step the allocator holds the model states and little else (the batch, a loss), so the
engine's accounting must be within 10% of what the allocator says it holds beyond the start.
Like with like: cuBLAS and cuBLASLt keep their workspaces (tens of MiB on Hopper, 66 MiB on the
H200 of 2026-11-27) in the caching allocator from the first matmul on; they are no model state,
so both readings are taken with the workspaces released."""


def memory(device: torch.device) -> Outcome:
    """`engine.memory_breakdown()` after an AdamW step against `torch.cuda.memory_allocated` (what
    stays) and `torch.cuda.max_memory_allocated` (the peak, which must cover it)."""
    skip = needs_cuda(device, "the CUDA caching allocator")
    if skip:
        return skip
    torch.cuda.synchronize()
    _release_blas_workspaces()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 0}}
    engine, *_ = initialize(model=make_gpt(device, MEMORY_SHAPE), config=config)
    data = tokens(4, MEMORY_SHAPE, steps=2).to(device)
    for step in range(2):
        rows = data[step * 4:(step + 1) * 4]
        engine.backward(engine(rows[:, :-1], rows[:, 1:]))
        engine.step()
    torch.cuda.synchronize()
    states = sum(engine.memory_breakdown().values())
    workspaces = torch.cuda.memory_allocated(device)
    _release_blas_workspaces()
    workspaces -= torch.cuda.memory_allocated(device)
    held = torch.cuda.memory_allocated(device) - base
    peak = torch.cuda.max_memory_allocated(device) - base
    err = abs(held - states) / states
    mib = 2**20
    return Outcome.judge(err <= MEMORY_RTOL and peak >= states,
                         f"memory_breakdown {states / mib:.1f} MiB, allocated after the step {held / mib:.1f} MiB "
                         f"({100 * err:.1f}% apart, bar {100 * MEMORY_RTOL:.0f}%), peak {peak / mib:.1f} MiB; "
                         f"cuBLAS workspaces {workspaces / mib:.1f} MiB left out")


def _release_blas_workspaces() -> None:
    """Free the cuBLAS / cuBLASLt workspaces the caching allocator holds (torch keeps one per
    handle and stream once a matmul ran); the next matmul allocates them again."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


# -- the planner's step time against the measured one ----------------------------------------

PLANNER_SHAPE = GPTConfig(vocab_size=4096, seq_len=1024, n_layer=12, n_head=12, d_model=768)
PLANNER_MICRO = 4
PLANNER_RATIO = (0.5, 2.5)
"""Measured over predicted step time. The planner prices a step from data-sheet constants (large
GEMMs at 70-75% of peak); eager PyTorch on a model this small reaches about half that share, so
the bar leaves room above 2x; beyond it the planner's constants or trident's kernels are off."""


def planner_step_time(device: torch.device) -> Outcome:
    """bf16 data parallelism of a GPT-2-small-shaped model: median measured step time (CUDA
    events) against `trident.planner`'s prediction for this GPU."""
    skip = needs_cuda(device, "a GPU's planner preset")
    if skip:
        return skip
    world = dist.get_world_size()
    gpu = gpu_preset_name(torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).total_memory)
    if gpu is None:
        return Outcome(SKIP, f"no planner preset for {torch.cuda.get_device_name(device)!r}")
    config = {"train_micro_batch_size_per_gpu": PLANNER_MICRO, "steps_per_print": 0, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 0}}
    engine, *_ = initialize(model=make_gpt(device, PLANNER_SHAPE), config=config)
    data = tokens(PLANNER_MICRO, PLANNER_SHAPE, steps=1).to(device)

    def step() -> None:
        engine.backward(engine(data[:, :-1], data[:, 1:]))
        engine.step()

    times = [elapsed_seconds(step, device) for _ in range(8)][3:]  # three warm-up steps
    measured = median(times)
    predicted = predicted_step_seconds(PLANNER_SHAPE, world, PLANNER_MICRO, gpu)
    ratio = measured / predicted
    low, high = PLANNER_RATIO
    return Outcome.judge(low <= ratio <= high, f"{gpu} x {world}: predicted {predicted * 1e3:.1f} ms, measured "
                                               f"{measured * 1e3:.1f} ms ({ratio:.2f}x, bar {low}-{high}x)")


def predicted_step_seconds(shape: GPTConfig, world: int, micro: int, gpu: str) -> float:
    """The planner's step time for bf16 stage-0 data parallelism over `world` GPUs. The one call
    into `trident.planner`'s public estimate API, kept here so a change there is a change here."""
    from trident.planner import Layout, Workload, estimate, make_cluster, model_from_gpt_config

    layout = Layout(dp=world, micro_batch=micro)
    workload = Workload(seq_len=shape.seq_len, global_batch=micro * world, precision="bf16", optimizer="adam")
    return estimate(model_from_gpt_config(shape), layout, make_cluster(gpu, world), workload).time.step


# -- DeepSpeed's get_accelerator() on a GPU ------------------------------------------------------

def accelerator(device: torch.device) -> Outcome:
    """`deepspeed.accelerator.get_accelerator()` answers for CUDA as DeepSpeed's does: device
    names, counts, the NCCL backend, fp16 support, synchronize and memory statistics."""
    skip = needs_cuda(device, "a CUDA accelerator")
    if skip:
        return skip
    from trident.deepspeed.accelerator import CUDA_Accelerator

    accel = CUDA_Accelerator()
    x = torch.ones(1024, device=device)
    accel.synchronize()
    checks = {
        "device_name": accel.device_name() == "cuda" and accel.device_name(0) == "cuda:0",
        "current_device_name": accel.current_device_name() == f"cuda:{torch.cuda.current_device()}",
        "device_count": accel.device_count() >= 1,
        "communication_backend_name": accel.communication_backend_name() == "nccl",
        "is_fp16_supported": accel.is_fp16_supported(),
        "memory_allocated": accel.memory_allocated() >= x.numel() * 4,
        "total > available memory": accel.total_memory() > accel.available_memory() > 0,
    }
    wrong = [name for name, ok in checks.items() if not ok]
    return Outcome.judge(not wrong, f"{len(checks) - len(wrong)} of {len(checks)} answers as DeepSpeed's"
                         + (f"; wrong: {', '.join(wrong)}" if wrong else ""))
