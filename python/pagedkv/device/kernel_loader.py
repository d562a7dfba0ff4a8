"""Kernel sources, their instantiations, and the loaders that compile them.

The CUDA C sources live in ``python/pagedkv/device/kernels/*.cu`` (the repository's top-level
``kernels`` is a link to that folder), so the wheel ships them as ``pagedkv/device/kernels``;
``PAGEDKV_KERNEL_DIR`` overrides that. Each source is templated by dtype and sizes;
:func:`name_expressions` lists every instantiation the pool can launch, and the same list is
used

- at run time by :class:`pagedkv.device.cupy_launch.CupyLauncher` (``cupy.RawModule`` with
  ``name_expressions`` and :func:`runtime_options`),
- in CI by :func:`compile_nvrtc` (``cuda.bindings.nvrtc``, ``-arch=sm_90``, ptxas report),
- in CI by the C++ host harness of the tests, which runs the same sources on the CPU.

A launcher is anything with ``kernel(name) -> KernelFn``, ``stream() -> object`` and
``num_sms``; a ``KernelFn`` is called like a CuPy ``RawKernel``:
``fn(grid, block, args, shared_mem=0, stream=None)`` where ``args`` holds ints (pointers,
passed as 64-bit), and numpy ``int32``/``int64``/``float32`` scalars (passed by value).

Nothing here imports cupy or torch at module import time.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

#: Storage dtype name -> C++ type of the kernels.
CTYPES: dict[str, str] = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
#: Bytes per element of each storage dtype.
ITEMSIZE: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}
#: head_dim values the decode attention kernel is instantiated for.
DECODE_HEAD_DIMS: tuple[int, ...] = (64, 128, 256)
#: Copy unit sizes (bytes) of the block copy kernel.
COPY_UNITS: tuple[int, ...] = (16, 8, 4, 2)
#: The kernel source files, each compiled as one module.
SOURCES: tuple[str, ...] = ("cache_ops.cu", "decode_attention.cu")

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


class KernelFn(Protocol):
    def __call__(
        self,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: tuple[Any, ...],
        *,
        shared_mem: int = 0,
        stream: Any = None,
    ) -> None: ...


class Launcher(Protocol):
    """What the device ops need: compiled kernels, the stream to launch on, the SM count."""

    num_sms: int

    def kernel(self, name: str) -> KernelFn: ...

    def stream(self) -> Any: ...


def kernel_dir() -> Path:
    """The folder that holds the ``.cu`` sources."""
    env = os.environ.get("PAGEDKV_KERNEL_DIR")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent
    # in the package (wheel or editable checkout)
    for cand in (here / "kernels",):
        if (cand / "cache_ops.cu").is_file():
            return cand
    raise FileNotFoundError(
        "pagedkv kernel sources not found in pagedkv/device/kernels; "
        "set PAGEDKV_KERNEL_DIR to the folder that holds cache_ops.cu"
    )


def kernel_source(filename: str) -> str:
    """The source of one kernel file with its local ``#include "..."`` files inlined
    (so that CuPy's cache key, the source text, covers the headers too)."""
    folder = kernel_dir()
    seen: set[str] = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        text = (folder / name).read_text()
        text = text.replace("#pragma once\n", "")

        def sub(m: re.Match[str]) -> str:
            inc = m.group(1)
            if (folder / inc).is_file():
                return expand(inc)
            return m.group(0)

        return _INCLUDE_RE.sub(sub, text)

    return expand(filename)


def write_kv_name(dtype: str, vec: int) -> str:
    return f"pkv_write_kv<{CTYPES[dtype]}, {vec}>"


def gather_kv_name(dtype: str, vec: int) -> str:
    return f"pkv_gather_kv<{CTYPES[dtype]}, {vec}>"


def copy_blocks_name(unit_bytes: int) -> str:
    return f"pkv_copy_blocks<{unit_bytes}>"


def decode_name(dtype: str, head_dim: int) -> str:
    return f"pkv_paged_decode<{CTYPES[dtype]}, {head_dim}>"


def merge_name(dtype: str) -> str:
    return f"pkv_merge_splits<{CTYPES[dtype]}>"


def vec_width(dtype: str) -> int:
    """Elements per 16-byte access."""
    return 16 // ITEMSIZE[dtype]


def decode_shape(dtype: str, head_dim: int) -> tuple[int, int]:
    """(VEC, BDX) of the decode kernel: elements per thread, threads per row."""
    vec = max(16 // ITEMSIZE[dtype], head_dim // 32)
    return vec, head_dim // vec


def name_expressions() -> dict[str, list[str]]:
    """Every instantiation, by source file."""
    cache: list[str] = []
    for dt in CTYPES:
        for vec in sorted({1, vec_width(dt)}):
            cache.append(write_kv_name(dt, vec))
            cache.append(gather_kv_name(dt, vec))
    cache += [copy_blocks_name(u) for u in COPY_UNITS]
    decode: list[str] = []
    for dt in CTYPES:
        decode += [decode_name(dt, hd) for hd in DECODE_HEAD_DIMS]
        decode.append(merge_name(dt))
    return {"cache_ops.cu": cache, "decode_attention.cu": decode}


def all_name_expressions() -> list[str]:
    return [n for names in name_expressions().values() for n in names]


def source_of(name: str) -> str:
    for src, names in name_expressions().items():
        if name in names:
            return src
    raise KeyError(f"unknown kernel instantiation {name!r}")


#: Options passed to NVRTC by the run-time loader besides the include folders (CuPy adds
#: -arch, -ftz=true, --device-as-default-execution-space and its own include folders).
RUNTIME_OPTIONS: tuple[str, ...] = ("--std=c++17",)


def include_options(dirs: Sequence[Path] | None = None) -> list[str]:
    """``-I`` options for the CUDA headers (``cuda_fp16.h``, ``cuda_bf16.h``), by default
    those of :func:`cuda_include_dirs`. The CI compile and the run-time compile both use
    this, so a pip-only install (no toolkit, no ``CUDA_PATH``) finds the same headers at run
    time as in CI."""
    return [f"-I{p}" for p in (cuda_include_dirs() if dirs is None else dirs)]


def runtime_options(dirs: Sequence[Path] | None = None) -> tuple[str, ...]:
    """Every option the run-time loader passes to ``cupy.RawModule``."""
    return (*RUNTIME_OPTIONS, *include_options(dirs))


def cuda_include_dirs() -> list[Path]:
    """The CUDA header folders of the installed PyPI wheels (``nvidia/cu13/include`` or
    ``nvidia/cu12/include``-style layouts, with ``cccl`` inside), then ``CUDA_PATH``."""
    found: list[Path] = []
    roots: list[Path] = []
    for entry in sys.path:
        p = Path(entry) / "nvidia"
        if p.is_dir():
            roots.append(p)
    for root in roots:
        for inc in sorted(root.glob("*/include")) + sorted(root.glob("cuda_runtime/include")):
            if (inc / "cuda_fp16.h").is_file() and inc not in found:
                found.append(inc)
                if (inc / "cccl").is_dir():
                    found.append(inc / "cccl")
    for var in ("CUDA_PATH", "CUDA_HOME"):
        base = os.environ.get(var)
        if base and (Path(base) / "include" / "cuda_fp16.h").is_file():
            found.append(Path(base) / "include")
            if (Path(base) / "include" / "cccl").is_dir():
                found.append(Path(base) / "include" / "cccl")
    return found


# --------------------------------------------------------------------------------------
# CI: compile with NVRTC for a given architecture, no GPU needed


@dataclass(frozen=True)
class KernelReport:
    """ptxas' verdict on one instantiation."""

    name: str
    lowered: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    shared_bytes: int


_RE_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_RE_FRAME = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_RE_REGS = re.compile(r"Used (\d+) registers")
_RE_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas_log(log: str) -> dict[str, dict[str, int]]:
    """Per mangled kernel name: registers, spill stores/loads, stack frame, static smem."""
    out: dict[str, dict[str, int]] = {}
    current: str | None = None
    for line in log.splitlines():
        m = _RE_ENTRY.search(line)
        if m:
            current = m.group(1)
            out[current] = {"registers": 0, "spill_stores": 0, "spill_loads": 0}
            out[current].update(stack_frame=0, shared_bytes=0)
            continue
        if current is None:
            continue
        m = _RE_FRAME.search(line)
        if m:
            out[current]["stack_frame"] = int(m.group(1))
            out[current]["spill_stores"] = int(m.group(2))
            out[current]["spill_loads"] = int(m.group(3))
        m = _RE_REGS.search(line)
        if m:
            out[current]["registers"] = int(m.group(1))
            s = _RE_SMEM.search(line)
            if s:
                out[current]["shared_bytes"] = int(s.group(1))
    return out


def compile_nvrtc(
    filename: str,
    names: Sequence[str] | None = None,
    arch: str = "sm_90",
    extra_options: Sequence[str] = (),
) -> tuple[bytes, list[KernelReport], str]:
    """Compile one kernel source to a cubin with ``cuda.bindings.nvrtc`` (no GPU or driver
    needed), with the options CuPy would use plus ``-Xptxas=-v``. Returns the cubin, a
    report per instantiation and the full log. Raises RuntimeError on a compile error."""
    nvrtc: Any = importlib.import_module("cuda.bindings.nvrtc")

    names = list(names) if names is not None else name_expressions()[filename]
    src = kernel_source(filename).encode()

    def check(res: Any) -> Any:
        err = res[0]
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC error {err}")
        return res[1] if len(res) == 2 else res[1:]

    prog = check(nvrtc.nvrtcCreateProgram(src, filename.encode(), 0, [], []))
    try:
        for n in names:
            check(nvrtc.nvrtcAddNameExpression(prog, n.encode()))
        opts = [
            f"-arch={arch}",
            "--std=c++17",
            "-ftz=true",
            "--device-as-default-execution-space",
            "-Xptxas=-v",
            *include_options(),
            *extra_options,
        ]
        res = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        log_size = check(nvrtc.nvrtcGetProgramLogSize(prog))
        buf = b" " * log_size
        check(nvrtc.nvrtcGetProgramLog(prog, buf))
        log = buf.decode(errors="replace").rstrip("\x00")
        if res[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC failed to compile {filename} for {arch}:\n{log}")
        size = check(nvrtc.nvrtcGetCUBINSize(prog))
        cubin = b" " * size
        check(nvrtc.nvrtcGetCUBIN(prog, cubin))
        lowered = {n: check(nvrtc.nvrtcGetLoweredName(prog, n.encode())).decode() for n in names}
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    info = parse_ptxas_log(log)
    reports = []
    for n in names:
        low = lowered[n]
        d = info.get(low)
        if d is None:
            raise RuntimeError(f"no ptxas report for {n} ({low}) in the log:\n{log}")
        reports.append(KernelReport(name=n, lowered=low, **d))
    return cubin, reports, log
