"""C++ host harness: compiles the kernel sources with g++ and the CUDA shim, and launches
them on CPU memory with the same launch code (pagedkv.device.device_ops) as CuPy on a GPU."""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from pagedkv.device import kernel_loader as K

HERE = Path(__file__).resolve().parent


def build_library() -> Path:
    """Build (or reuse) the shared library with every instantiation registered."""
    names = K.all_name_expressions()
    lines = ['#include "cuda_host_shim.h"']
    lines += [f'#include "{src}"' for src in K.SOURCES]
    lines += [f"PKV_ENTRY({n})" for n in names]
    unit = "\n".join(lines) + "\n"
    h = hashlib.sha256(unit.encode())
    for f in [HERE / "cuda_host_shim.h", *sorted(K.kernel_dir().glob("*.cu*"))]:
        h.update(f.read_bytes())
    incs = K.cuda_include_dirs()
    if not incs:
        raise RuntimeError(
            "CUDA headers not found: pip install nvidia-cuda-runtime nvidia-cuda-cccl"
        )
    h.update(repr(incs).encode())
    root = Path(os.environ.get("PAGEDKV_HOST_BUILD", Path(tempfile.gettempdir()) / "pagedkv-host"))
    out = root / h.hexdigest()[:16]
    lib = out / "kernels_host.so"
    if lib.is_file():
        return lib
    out.mkdir(parents=True, exist_ok=True)
    (out / "instances.cpp").write_text(unit)
    tmp = out / f"kernels_host.{os.getpid()}.so"
    cmd = [
        os.environ.get("CXX", "g++"),
        "-std=c++20",
        "-O1",
        "-shared",
        "-fPIC",
        "-pthread",
        "-Wall",
        "-Wno-unknown-pragmas",
        f"-I{HERE}",
        f"-I{K.kernel_dir()}",
        *(f"-I{p}" for p in incs),
        str(out / "instances.cpp"),
        "-o",
        str(tmp),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"g++ failed:\n{' '.join(cmd)}\n{res.stderr}")
    os.replace(tmp, lib)
    return lib


class KernelMisuseError(RuntimeError):
    """The kernel did something undefined on a GPU (e.g. a full-mask warp shuffle on a
    partial warp); the shim caught it during the launch."""


class HostKernel:
    def __init__(self, lib: ctypes.CDLL, name: str) -> None:
        self._lib = lib
        self.name = name
        self.launches = 0

    def __call__(
        self,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: tuple[Any, ...],
        *,
        shared_mem: int = 0,
        stream: Any = None,
    ) -> None:
        holders: list[Any] = []
        sizes = []
        for a in args:
            if isinstance(a, np.int32):
                c: Any = ctypes.c_int32(int(a))
            elif isinstance(a, np.int64):
                c = ctypes.c_int64(int(a))
            elif isinstance(a, np.float32):
                c = ctypes.c_float(float(a))
            elif isinstance(a, int) and not isinstance(a, bool):
                c = ctypes.c_uint64(a)  # a pointer, or CuPy's long long
            else:
                raise TypeError(f"{self.name}: argument {a!r} of type {type(a)} not supported")
            holders.append(c)
            sizes.append(ctypes.sizeof(c))
        n = len(holders)
        ptrs = (ctypes.c_void_p * n)(
            *[ctypes.cast(ctypes.pointer(c), ctypes.c_void_p) for c in holders]
        )
        szs = (ctypes.c_int * n)(*sizes)
        g = [*grid, 1, 1][:3]
        b = [*block, 1, 1][:3]
        rc = self._lib.pkv_host_launch(
            self.name.encode(), *g, *b, ctypes.c_ulonglong(shared_mem), ptrs, szs, n
        )
        if rc == -1:
            raise KeyError(f"kernel {self.name} not registered")
        if rc == -2:
            raise TypeError(f"{self.name}: argument count or sizes do not match the kernel")
        if rc == -3:
            why = self._lib.pkv_host_error().decode()
            raise KernelMisuseError(f"{self.name} grid={g} block={b}: {why}")
        self.launches += 1


class HostLauncher:
    """A pagedkv.device.kernel_loader.Launcher that runs kernels through the C++ harness."""

    def __init__(self, num_sms: int = 4) -> None:
        self._lib = ctypes.CDLL(str(build_library()))
        self._lib.pkv_host_launch.restype = ctypes.c_int
        self._lib.pkv_host_error.restype = ctypes.c_char_p
        self._lib.pkv_host_launch.argtypes = [
            ctypes.c_char_p,
            *([ctypes.c_uint] * 6),
            ctypes.c_ulonglong,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int,
        ]
        self.num_sms = num_sms
        self.kernels: dict[str, HostKernel] = {}

    def kernel(self, name: str) -> HostKernel:
        k = self.kernels.get(name)
        if k is None:
            if not self._lib.pkv_host_has(name.encode()):
                raise KeyError(f"kernel {name} not registered")
            k = HostKernel(self._lib, name)
            self.kernels[name] = k
        return k

    def stream(self) -> None:
        return None
