"""`deepspeed.accelerator`: `get_accelerator()` and the accelerator object DeepSpeed scripts query
(device name, current device, counts, synchronize, seeds, bf16/fp16 support, memory statistics,
the communication backend's name), for CUDA and for the CPU.

The choice follows DeepSpeed's: `DS_ACCELERATOR` ("cuda" or "cpu") when set, else CUDA when a GPU
is visible, else the CPU. Answers mean what DeepSpeed's CUDA and CPU accelerators return: the
CPU's "device" is the host (`device_name()` is "cpu", memory statistics are this process's
resident memory and the machine's), its backend is gloo (trident's, and DeepSpeed's without
oneCCL). DeepSpeed's compiled-op builders are not here (`NotInTrident` names them).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from trident.deepspeed.engine.surface import NotInTrident

__all__ = ["get_accelerator", "set_accelerator", "is_current_accelerator_supported", "CUDA_Accelerator",
           "CPU_Accelerator", "DeepSpeedAccelerator"]

_OP_BUILDERS = ("op_builder_dir", "create_op_builder", "get_op_builder", "build_extension")


class DeepSpeedAccelerator:
    """What both accelerators share: seeds, streams and tensors through the device's torch module."""

    _name = "abstract"
    _communication_backend_name = "gloo"
    _compile_backend = "inductor"

    def is_synchronized_device(self) -> bool:
        return self._name == "cpu"

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def is_available(self) -> bool:
        return True

    def random(self):
        return torch.random

    def manual_seed(self, seed: int):
        return torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)
        if torch.cuda.is_available():
            torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.default_generator

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.set_rng_state(new_state)

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float]
        dtypes += [torch.half] if self.is_fp16_supported() else []
        return dtypes + ([torch.bfloat16] if self.is_bf16_supported() else [])

    def is_triton_supported(self) -> bool:
        return False

    def range_push(self, msg: str) -> None:
        """An NVTX range where CUDA has one; nothing on the CPU."""

    def range_pop(self) -> None:
        """Closes `range_push`'s range."""

    def lazy_call(self, callback) -> Any:
        return callback()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if torch.cuda.is_available() else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if torch.cuda.is_available() else False

    def export_envs(self) -> list[str]:
        return []

    def visible_devices_envs(self) -> list[str]:
        return []

    def set_visible_devices_envs(self, current_env: dict, local_accelerator_ids: list[int]) -> None:
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        self._compile_backend = backend

    def __getattr__(self, name: str):
        if name in _OP_BUILDERS:
            raise NotInTrident(f"get_accelerator().{name} is not available in trident: DeepSpeed's compiled ops "
                               "are not used (trident's optimizers are torch code; see trident.ops)")
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")


class CUDA_Accelerator(DeepSpeedAccelerator):  # noqa: N801  (DeepSpeed's class name)
    _name = "cuda"
    _communication_backend_name = "nccl"

    def device_name(self, device_index: int | None = None) -> str:
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index: int | None = None):
        return torch.cuda.device(device_index)

    def set_device(self, device_index: int) -> None:
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def synchronize(self, device_index: int | None = None) -> None:
        torch.cuda.synchronize(device_index)

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        return torch.cuda.is_available()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    memory_cached, max_memory_cached = memory_reserved, max_memory_reserved

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict:
        return torch.cuda.memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        return torch.cuda.get_device_properties(device_index or 0).total_memory

    def available_memory(self, device_index: int | None = None) -> int:
        return torch.cuda.mem_get_info(device_index)[0]

    def manual_seed(self, seed: int):
        return torch.cuda.manual_seed(seed)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.cuda.default_generators[device_index]

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]

    def Stream(self, *args, **kwargs):  # noqa: N802  (DeepSpeed's name)
        return torch.cuda.Stream(*args, **kwargs)

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: int | None = None):
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: int | None = None):
        return torch.cuda.default_stream(device_index)

    def Event(self, **kwargs):  # noqa: N802  (DeepSpeed's name)
        return torch.cuda.Event(**kwargs)


class CPU_Accelerator(DeepSpeedAccelerator):  # noqa: N801  (DeepSpeed's class name)
    _name = "cpu"
    _communication_backend_name = "gloo"

    def __init__(self) -> None:
        self._peak_rss = 0

    def device_name(self, device_index: int | None = None) -> str:
        return "cpu"

    def device(self, device_index: int | None = None) -> None:
        return None

    def set_device(self, device_index: int) -> None:
        """Nothing to select: the CPU is one device for every rank."""

    def current_device(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    def current_device_name(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", 1)))

    def synchronize(self, device_index: int | None = None) -> None:
        """The CPU runs synchronously: nothing to wait for."""

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except (AttributeError, RuntimeError):
            return False

    def empty_cache(self) -> None:
        """Freed host memory goes back to the allocator by itself."""

    def _rss(self) -> int:
        import psutil
        rss = psutil.Process().memory_info().rss
        self._peak_rss = max(self._peak_rss, rss)
        return rss

    def memory_allocated(self, device_index: int | None = None) -> int:
        return self._rss()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        self._rss()
        return self._peak_rss

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self._peak_rss = 0
        self._rss()

    memory_reserved, max_memory_reserved = memory_allocated, max_memory_allocated
    memory_cached, max_memory_cached = memory_allocated, max_memory_allocated
    reset_max_memory_cached = reset_peak_memory_stats = reset_max_memory_allocated

    def memory_stats(self, device_index: int | None = None) -> dict:
        return {"allocated_bytes.all.current": self._rss(), "allocated_bytes.all.peak": self._peak_rss}

    def total_memory(self, device_index: int | None = None) -> int:
        import psutil
        return psutil.virtual_memory().total

    def available_memory(self, device_index: int | None = None) -> int:
        import psutil
        return psutil.virtual_memory().available

    def Stream(self, *args, **kwargs):  # noqa: N802  (DeepSpeed's name)
        return None

    def stream(self, stream):
        import contextlib
        return contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> None:
        return None

    default_stream = current_stream

    def Event(self, **kwargs) -> None:  # noqa: N802  (DeepSpeed's name)
        return None


_current: DeepSpeedAccelerator | None = None


def get_accelerator() -> DeepSpeedAccelerator:
    """The accelerator of this process: `DS_ACCELERATOR` when set ("cuda" or "cpu"), else CUDA
    when a GPU is visible, else the CPU."""
    global _current
    if _current is None:
        wanted = os.environ.get("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
        if wanted not in ("cuda", "cpu"):
            raise ValueError(f"DS_ACCELERATOR={wanted!r}: trident has the 'cuda' and 'cpu' accelerators; "
                             "unset it or choose one of them")
        _current = CUDA_Accelerator() if wanted == "cuda" else CPU_Accelerator()
    return _current


def set_accelerator(accel: DeepSpeedAccelerator) -> None:
    global _current
    _current = accel


def is_current_accelerator_supported() -> bool:
    return get_accelerator()._name in ("cuda", "cpu")
