"""The accelerator a DeepSpeed script asks about, answered for the device zerodp trains on.

`CpuAccelerator` answers as DeepSpeed's CPU accelerator does and
`DeviceAccelerator` as its CUDA accelerator does (for CUDA, and for any
device type whose torch module has CUDA's functions, such as XPU). Each
method is the torch call of the same meaning; nothing here builds kernels
(DeepSpeed's op builders have no counterpart: `create_op_builder` returns
None, as DeepSpeed's does for an op it cannot build).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from typing import Any

import torch


class _Accelerator:
    """What every device answers alike."""

    _name: str
    _communication_backend_name: str
    _compile_backend: str = "inductor"

    def __repr__(self) -> str:
        return f"<zerodp accelerator {self._name!r}>"

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def random(self) -> Any:
        return torch.random

    def initial_seed_all(self) -> int:
        return torch.initial_seed()

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        return callback()

    def is_triton_supported(self) -> bool:
        return False

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32]
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        return dtypes

    def is_bf16_supported(self) -> bool:
        raise NotImplementedError

    def is_fp16_supported(self) -> bool:
        raise NotImplementedError

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        self._compile_backend = backend

    def create_op_builder(self, op_name: str) -> None:
        """None: zerodp builds no kernels (its optimizers are torch's; see `zerodp.ops`)."""
        return None

    def get_op_builder(self, class_name: str) -> None:
        return None

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]

    def set_visible_devices_envs(self, current_env: dict[str, str], ids: list[int]) -> None:
        for name in self.visible_devices_envs():
            current_env[name] = ",".join(str(i) for i in ids)

    def export_envs(self) -> list[str]:
        return []

    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        return None

    def range_pop(self, domain: Any = None) -> None:
        return None


class CpuAccelerator(_Accelerator):
    """The CPU, answering as DeepSpeed's CPU accelerator (DS_ACCELERATOR=cpu) does.

    Memory statistics are the process's resident set (RSS), as there; the
    device index of a CPU rank is its local rank.
    """

    _name = "cpu"
    _communication_backend_name = "gloo"

    def __init__(self) -> None:
        self._peak_rss = 0

    def is_synchronized_device(self) -> bool:
        return True

    def use_host_timers(self) -> bool:
        return True

    def resolves_data_dependency(self) -> bool:
        return True

    def handles_memory_backpressure(self) -> bool:
        return True

    def device_name(self, device_index: int | None = None) -> str:
        return "cpu"

    def device(self, device_index: int | None = None) -> None:
        return None

    def set_device(self, device_index: int) -> None:
        return None

    def current_device(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    def current_device_name(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        """Ranks a node runs: `LOCAL_WORLD_SIZE` (torchrun's), else `LOCAL_SIZE`, else 1."""
        for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
            if int(os.environ.get(name, "0")) > 0:
                return int(os.environ[name])
        return 1

    def is_available(self) -> bool:
        return True

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.set_rng_state(new_state)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def manual_seed(self, seed: int) -> Any:
        return torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> Any:
        return torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def default_generator(self, device_index: int | None = None) -> torch.Generator:
        return torch.default_generator

    @property
    def Stream(self) -> None:  # noqa: N802 (DeepSpeed's name)
        return None

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> None:
        return None

    def default_stream(self, device_index: int | None = None) -> None:
        return None

    @property
    def Event(self) -> None:  # noqa: N802 (DeepSpeed's name)
        return None

    def empty_cache(self) -> None:
        return None

    def _rss(self) -> int:
        rss = _resident_bytes()
        self._peak_rss = max(self._peak_rss, rss)
        return rss

    def memory_allocated(self, device_index: int | None = None) -> int:
        return self._rss()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        self._rss()
        return self._peak_rss

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self._peak_rss = _resident_bytes()

    memory_cached = memory_allocated
    memory_reserved = memory_allocated
    max_memory_cached = max_memory_allocated
    max_memory_reserved = max_memory_allocated
    reset_max_memory_cached = reset_max_memory_allocated
    reset_peak_memory_stats = reset_max_memory_allocated

    def memory_stats(self, device_index: int | None = None) -> dict[str, int]:
        current = self._rss()
        return {"allocated_bytes.all.current": current, "allocated_bytes.all.peak": self._peak_rss}

    def total_memory(self, device_index: int | None = None) -> int:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    def available_memory(self, device_index: int | None = None) -> int:
        return _available_bytes()

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        """As DeepSpeed's CPU accelerator: whether oneDNN has fp16 kernels on this CPU."""
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except (AttributeError, RuntimeError):
            return False

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return False

    def create_graph(self) -> None:
        return None

    def capture_to_graph(
        self, graph: Any, pool: Any = None, stream: Any = None
    ) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def replay_graph(self, graph: Any) -> None:
        return None

    FloatTensor = torch.FloatTensor
    HalfTensor = torch.HalfTensor
    BFloat16Tensor = torch.BFloat16Tensor
    DoubleTensor = torch.DoubleTensor
    IntTensor = torch.IntTensor
    LongTensor = torch.LongTensor
    ByteTensor = torch.ByteTensor


def _resident_bytes() -> int:
    """This process's resident set size (Linux's /proc; elsewhere the peak from getrusage)."""
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
        return pages * int(os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError):
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


class DeviceAccelerator(_Accelerator):
    """CUDA (or another device whose torch module has CUDA's functions), answering as
    DeepSpeed's CUDA accelerator does."""

    def __init__(self, device_type: str, backend: str) -> None:
        self._name = device_type
        self._communication_backend_name = backend
        self._module: Any = getattr(torch, device_type)

    def is_synchronized_device(self) -> bool:
        return False

    def use_host_timers(self) -> bool:
        return False

    def resolves_data_dependency(self) -> bool:
        return False

    def handles_memory_backpressure(self) -> bool:
        return False

    def device_name(self, device_index: int | None = None) -> str:
        return self._name if device_index is None else f"{self._name}:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        if device_index is None:
            return torch.device(self._name)
        return torch.device(self._name, device_index)

    def set_device(self, device_index: int) -> None:
        self._module.set_device(device_index)

    def current_device(self) -> int:
        return int(self._module.current_device())

    def current_device_name(self) -> str:
        return f"{self._name}:{self.current_device()}"

    def device_count(self) -> int:
        return int(self._module.device_count())

    def is_available(self) -> bool:
        return bool(self._module.is_available())

    def synchronize(self, device_index: int | None = None) -> None:
        self._module.synchronize(device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if device_index is None:
            self._module.set_rng_state(new_state)
        else:
            self._module.set_rng_state(new_state, device_index)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if device_index is None:
            return self._module.get_rng_state()
        return self._module.get_rng_state(device_index)

    def manual_seed(self, seed: int) -> None:
        self._module.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        self._module.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return int(self._module.initial_seed())

    def default_generator(self, device_index: int) -> torch.Generator:
        return self._module.default_generators[device_index]

    @property
    def Stream(self) -> Any:  # noqa: N802 (DeepSpeed's name)
        return self._module.Stream

    def stream(self, stream: Any) -> Any:
        return self._module.stream(stream)

    def current_stream(self, device_index: int | None = None) -> Any:
        return self._module.current_stream(device_index)

    def default_stream(self, device_index: int | None = None) -> Any:
        return self._module.default_stream(device_index)

    @property
    def Event(self) -> Any:  # noqa: N802 (DeepSpeed's name)
        return self._module.Event

    def empty_cache(self) -> None:
        self._module.empty_cache()

    def __getattr__(self, name: str) -> Any:
        """The memory statistics: torch's functions of the same name."""
        if name in _MEMORY_FUNCTIONS:
            return getattr(self._module, _MEMORY_FUNCTIONS[name])
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def total_memory(self, device_index: int | None = None) -> int:
        return int(self._module.get_device_properties(device_index).total_memory)

    def available_memory(self, device_index: int | None = None) -> int:
        free, _ = self._module.mem_get_info(device_index)
        return int(free)

    def is_bf16_supported(self) -> bool:
        supported = getattr(self._module, "is_bf16_supported", None)
        return bool(supported()) if supported is not None else True

    def is_fp16_supported(self) -> bool:
        return True

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def create_graph(self) -> Any:
        return self._module.CUDAGraph()

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> Any:
        return self._module.graph(graph, pool, stream)

    def replay_graph(self, graph: Any) -> None:
        graph.replay()

    def export_envs(self) -> list[str]:
        return ["NCCL"] if self._name == "cuda" else []

    def _tensor_type(self, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        return functools.partial(torch.tensor, dtype=dtype, device=self._name)

    @property
    def FloatTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802 (DeepSpeed's name)
        return self._tensor_type(torch.float32)

    @property
    def HalfTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802
        return self._tensor_type(torch.float16)

    @property
    def BFloat16Tensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802
        return self._tensor_type(torch.bfloat16)

    @property
    def DoubleTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802
        return self._tensor_type(torch.float64)

    @property
    def IntTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802
        return self._tensor_type(torch.int32)

    @property
    def LongTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802
        return self._tensor_type(torch.int64)

    @property
    def ByteTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802
        return self._tensor_type(torch.uint8)


# DeepSpeed's memory statistics -> the torch function that answers them.
_MEMORY_FUNCTIONS = {
    "memory_allocated": "memory_allocated",
    "max_memory_allocated": "max_memory_allocated",
    "reset_max_memory_allocated": "reset_peak_memory_stats",
    "memory_reserved": "memory_reserved",
    "max_memory_reserved": "max_memory_reserved",
    "memory_cached": "memory_reserved",
    "max_memory_cached": "max_memory_reserved",
    "reset_max_memory_cached": "reset_peak_memory_stats",
    "memory_stats": "memory_stats",
    "reset_peak_memory_stats": "reset_peak_memory_stats",
}
