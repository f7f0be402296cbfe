"""What the GPU check's bodies share: the outcome type, the small model, its data and the reference.

Every body runs on every rank of a fresh process group and returns an `Outcome`: PASS or FAIL
with the measured figure, or SKIP when this device cannot run it (a CUDA-only measurement on a
CPU device: the check skips itself, so its logic can be exercised on CPU without pretending).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from trident.models.gpt import GPT, GPTConfig
from trident.testing.parity import SerialRun, optimizer_section, state_report, train_serial

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclass(frozen=True)
class Outcome:
    """One rank's verdict on one check: status and a one-line figure."""

    status: str
    detail: str

    @classmethod
    def judge(cls, ok: bool, detail: str) -> "Outcome":
        return cls(PASS if ok else FAIL, detail)


def needs_cuda(device: torch.device, what: str) -> Outcome | None:
    """SKIP when `device` is not a CUDA device (the body cannot measure `what` there)."""
    if device.type == "cuda":
        return None
    return Outcome(SKIP, f"{what} needs a CUDA device, this rank has {device.type}")


def elapsed_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Time of `fn`: on CUDA the GPU time of what it enqueues on the current stream (and what that
    stream waits for), from CUDA events; on CPU the wall clock."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


# -- the small model every equivalence check trains -------------------------------------------

SMALL = GPTConfig(vocab_size=64, seq_len=16, n_layer=4, n_head=4, d_model=64, dropout=0.0, bias=False)
"""No biases: a key bias gets a zero gradient in exact arithmetic, so its gradient is rounding
noise (see tests/parity/test_dp_equivalence.py). 4 layers split evenly over 2 pipeline stages,
4 heads over 2 tensor-parallel ranks."""
STEPS = 5
MICRO = 2
LR = 0.5
CLIP = 0.05
"""SGD with momentum and a clip below the gradient norm on every step: a wrong gradient scale
changes the update (Adam would hide it)."""
RTOL = {"cpu": 1e-5, "cuda": 1e-4}
"""fp32 relative error allowed against one process. cuBLAS picks kernels (and split-K summation
orders) by matrix shape, and a rank's micro-batch has another shape than the serial global
batch, so CUDA gets a looser bar than CPU, where the project holds every layout to 1e-5."""


def exact_fp32(device: torch.device) -> None:
    """No TF32 in fp32 matmuls: an equivalence check compares fp32 against fp32."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def make_gpt(device: torch.device, shape: GPTConfig = SMALL) -> GPT:
    torch.manual_seed(0)
    return GPT(shape).to(device)


def tokens(global_batch: int, shape: GPTConfig = SMALL, steps: int = STEPS) -> torch.Tensor:
    """`steps` global batches of token rows (inputs and shifted targets), the same on every rank."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, shape.vocab_size, (steps * global_batch, shape.seq_len + 1), generator=g)


def rank_rows(data: torch.Tensor, step: int, global_batch: int, dp_rank: int, dp_size: int) -> torch.Tensor:
    """This data-parallel rank's contiguous share of global batch `step`."""
    per_rank = global_batch // dp_size
    return data[step * global_batch + dp_rank * per_rank:][:per_rank]


def serial_run(device: torch.device, global_batch: int) -> SerialRun:
    """The reference: plain PyTorch, one process, the whole global batch per step, on `device`."""
    data = tokens(global_batch).to(device)
    batches = [(b[:, :-1], b[:, 1:]) for b in data.split(global_batch)]
    return train_serial(make_gpt(device), batches, "sgd", LR, CLIP)


def engine_config(micro: int, gas: int = 1, **sections) -> dict:
    """The trident config of an equivalence run: SGD + momentum, active clipping, fp32."""
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
            "optimizer": optimizer_section("sgd", LR), "gradient_clipping": CLIP, "steps_per_print": 0,
            **sections}


def compare(device: torch.device, weights: dict, reference: dict, norms: list, ref_norms: list,
            layout: str) -> Outcome:
    """PASS when the final weights and every step's global gradient norm match the reference."""
    weight_err = state_report({k: v.float().cpu() for k, v in weights.items()},
                              {k: reference[k].float().cpu() for k in weights})[0][1]
    norm_err = max(abs(a - e) / e if a is not None else float("inf") for a, e in zip(norms, ref_norms))
    bar = RTOL[device.type]
    worst = max(weight_err, norm_err)
    return Outcome.judge(worst <= bar, f"{layout}: weights rel err {weight_err:.1e}, grad norms rel err "
                                       f"{norm_err:.1e} over {len(norms)} steps (bar {bar:.0e})")
