"""Run time: compile the kernels with CuPy and launch them on the device and stream that
torch is using for the pool.

Each decision of the launch path is a small function that the tests exercise without
CuPy or a GPU; the CuPy calls around them are thin:

- :func:`device_index`: which GPU the launches and allocations of a pool run on;
- :func:`cupy_stream`: how torch's current stream reaches CuPy (the CUDA stream protocol
  where both sides have it, else ``cupy.cuda.ExternalStream`` on the raw handle);
- :func:`pagedkv.device.kernel_loader.runtime_options`: the NVRTC options, with the same CUDA
  include folders as the CI compile;
- :class:`DeviceKernel`: every launch runs inside ``cupy.cuda.Device(N)`` of its pool,
  whatever device the calling thread has current (several GPUs in one process).

Nothing here imports cupy or torch at module import time.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from pagedkv.device import kernel_loader as K


def device_index(device: Any, current_device: Callable[[], int]) -> int | None:
    """The CUDA ordinal a ``torch.device`` names: its index, or the current device for a
    bare ``"cuda"``; None for any other device type (nothing to enter)."""
    if device.type != "cuda":
        return None
    return int(device.index) if device.index is not None else int(current_device())


def torch_device_guard(device: Any) -> AbstractContextManager[Any]:
    """torch's guard for the pool's GPU (torch work such as output allocation and the
    pinned-memory copies of ids then lands on that device); a no-op off CUDA."""
    import torch

    index = device_index(device, torch.cuda.current_device)
    if index is None:
        return nullcontext()
    return torch.cuda.device(index)


def stream_protocol_handle(stream: Any) -> int | None:
    """The raw handle an object offers through the CUDA stream protocol
    (``__cuda_stream__() -> (0, handle)``), or None when it does not speak version 0."""
    proto = getattr(stream, "__cuda_stream__", None)
    if not callable(proto):
        return None
    try:
        version, handle = proto()
    except (TypeError, ValueError):
        return None
    if version != 0 or isinstance(handle, bool) or not isinstance(handle, int):
        return None
    return handle


def cupy_stream(torch_stream: Any, cupy_cuda: Any, device_index: int) -> Any:
    """The CuPy stream object for torch's stream: ``cupy.cuda.Stream.from_external`` when
    this CuPy has it and the torch stream speaks the stream protocol (CuPy 14, torch 2.10
    and later), else ``cupy.cuda.ExternalStream(handle, device_index)`` on the raw handle
    (``torch_stream.cuda_stream``), which every CuPy since 10 accepts."""
    handle = stream_protocol_handle(torch_stream)
    from_external = getattr(cupy_cuda.Stream, "from_external", None)
    if from_external is not None and handle is not None:
        return from_external(torch_stream)
    if handle is None:
        handle = int(torch_stream.cuda_stream)
    return cupy_cuda.ExternalStream(handle, device_index)


class DeviceKernel:
    """A compiled kernel that launches inside its device's context. CuPy launches on the
    thread's current device, and a function loaded on one GPU is not valid on another, so
    a process that drives pools on several GPUs must enter the pool's device each time."""

    def __init__(
        self, fn: Any, device: Callable[[int], AbstractContextManager[Any]], index: int
    ) -> None:
        self._fn = fn
        self._device = device
        self.index = index

    def __call__(
        self,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: tuple[Any, ...],
        *,
        shared_mem: int = 0,
        stream: Any = None,
    ) -> None:
        with self._device(self.index):
            self._fn(grid, block, args, shared_mem=shared_mem, stream=stream)


def _torch_current_stream(index: int) -> Any:
    import torch

    return torch.cuda.current_stream(index)


class CupyLauncher:
    """Compiles the kernel modules with ``cupy.RawModule`` on first use (all instantiations
    of a source at once, cached on disk by CuPy) on device ``device_index``, and launches
    there on the stream torch is currently using. ``cupy`` and ``current_stream`` replace
    the cupy module and ``torch.cuda.current_stream`` (tests)."""

    def __init__(
        self,
        device_index: int = 0,
        *,
        cupy: Any = None,
        current_stream: Callable[[int], Any] | None = None,
    ) -> None:
        self._cupy: Any = cupy if cupy is not None else importlib.import_module("cupy")
        self._current_stream = current_stream or _torch_current_stream
        self.device_index = device_index
        self._modules: dict[str, Any] = {}
        self._kernels: dict[str, DeviceKernel] = {}
        self._stream_cache: tuple[int, Any] | None = None
        with self._cupy.cuda.Device(device_index):
            attrs = self._cupy.cuda.runtime.getDeviceProperties(device_index)
        self.num_sms: int = int(attrs["multiProcessorCount"])

    def _module(self, filename: str) -> Any:
        mod = self._modules.get(filename)
        if mod is None:
            mod = self._cupy.RawModule(
                code=K.kernel_source(filename),
                options=K.runtime_options(),
                name_expressions=K.name_expressions()[filename],
            )
            self._modules[filename] = mod
        return mod

    def kernel(self, name: str) -> DeviceKernel:
        k = self._kernels.get(name)
        if k is None:
            with self._cupy.cuda.Device(self.device_index):
                fn = self._module(K.source_of(name)).get_function(name)
            k = DeviceKernel(fn, self._cupy.cuda.Device, self.device_index)
            self._kernels[name] = k
        return k

    def stream(self) -> Any:
        ts = self._current_stream(self.device_index)
        # One CuPy wrapper per torch stream (the raw handle names it), not one per launch.
        handle = stream_protocol_handle(ts)
        if handle is None:
            handle = int(ts.cuda_stream)
        cached = self._stream_cache
        if cached is not None and cached[0] == handle:
            return cached[1]
        cs = cupy_stream(ts, self._cupy.cuda, self.device_index)
        self._stream_cache = (handle, cs)
        return cs

    def warmup(self) -> None:
        """Compile (or load from CuPy's cache) every instantiation."""
        for name in K.all_name_expressions():
            self.kernel(name)


_launchers: dict[int, CupyLauncher] = {}


def cupy_launcher(device_index: int) -> CupyLauncher:
    """One launcher per device, shared by all pools."""
    launcher = _launchers.get(device_index)
    if launcher is None:
        launcher = CupyLauncher(device_index)
        _launchers[device_index] = launcher
    return launcher
