"""The run-time launch path (pagedkv.device.cupy_launch) without CuPy or a GPU.

Its decisions are small functions (which device, which stream object, which NVRTC
options) exercised here with real objects: small classes that have or lack what CuPy and
torch offer (the CUDA stream protocol, ``Stream.from_external``), and a stand-in cupy
namespace that records which device is current when a module is built, a function is
loaded and a kernel is launched.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedkv.device import cupy_launch as L
from pagedkv.device import kernel_loader as K

torch = pytest.importorskip("torch")

# ---------------------------------------------------------------------------------------
# which device


def test_device_index_selection():
    never = _raise_current
    assert L.device_index(torch.device("cuda", 3), never) == 3
    assert L.device_index(torch.device("cuda:1"), never) == 1
    assert L.device_index(torch.device("cuda"), lambda: 5) == 5  # bare "cuda": current
    assert L.device_index(torch.device("cpu"), never) is None
    assert L.device_index(torch.device("meta"), never) is None


def _raise_current() -> int:
    raise AssertionError("the current device must not decide an explicit index")


def test_torch_guard_off_cuda_is_a_no_op():
    with L.torch_device_guard(torch.device("cpu")) as g:
        assert g is None


# ---------------------------------------------------------------------------------------
# which stream object


class RawTorchStream:
    """A torch stream as older torch has it: ``cuda_stream``, no stream protocol."""

    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle


class ProtocolTorchStream(RawTorchStream):
    """A torch stream that speaks the CUDA stream protocol (torch 2.10 and later)."""

    def __init__(self, handle: int, version: int = 0) -> None:
        super().__init__(handle)
        self.version = version

    def __cuda_stream__(self) -> tuple[int, int]:
        return (self.version, self.cuda_stream)


class ExternalStream:
    def __init__(self, ptr: int, device_id: int = -1) -> None:
        self.ptr = ptr
        self.device_id = device_id


class Cupy13Cuda:
    """cupy.cuda of CuPy 13: ExternalStream only."""

    class Stream:
        pass

    ExternalStream = ExternalStream


class Cupy14Cuda(Cupy13Cuda):
    """cupy.cuda of CuPy 14: Stream.from_external takes a stream-protocol object."""

    class Stream:
        @classmethod
        def from_external(cls, obj: Any) -> tuple[str, int]:
            version, handle = obj.__cuda_stream__()
            assert version == 0
            return ("from_external", handle)


def test_stream_protocol_handle():
    assert L.stream_protocol_handle(ProtocolTorchStream(77)) == 77
    assert L.stream_protocol_handle(RawTorchStream(77)) is None
    assert L.stream_protocol_handle(ProtocolTorchStream(77, version=1)) is None


def test_stream_without_protocol_falls_back_to_external_stream():
    s = L.cupy_stream(RawTorchStream(0x1234), Cupy14Cuda, 2)
    assert isinstance(s, ExternalStream)
    assert (s.ptr, s.device_id) == (0x1234, 2)


def test_stream_with_protocol_but_old_cupy_uses_external_stream():
    s = L.cupy_stream(ProtocolTorchStream(0x99), Cupy13Cuda, 1)
    assert isinstance(s, ExternalStream)
    assert (s.ptr, s.device_id) == (0x99, 1)


def test_stream_protocol_on_both_sides_uses_from_external():
    assert L.cupy_stream(ProtocolTorchStream(0x42), Cupy14Cuda, 0) == ("from_external", 0x42)


def test_stream_unknown_protocol_version_falls_back():
    s = L.cupy_stream(ProtocolTorchStream(0x42, version=3), Cupy14Cuda, 0)
    assert isinstance(s, ExternalStream) and s.ptr == 0x42


# ---------------------------------------------------------------------------------------
# which include folders


def test_runtime_compile_gets_the_ci_include_dirs():
    dirs = K.cuda_include_dirs()
    if not dirs:
        pytest.skip("CUDA header wheels not installed")
    opts = K.runtime_options()
    assert opts[: len(K.RUNTIME_OPTIONS)] == K.RUNTIME_OPTIONS
    incs = [o for o in opts if o.startswith("-I")]
    assert incs == K.include_options() == [f"-I{d}" for d in dirs]
    assert any((Path(o[2:]) / "cuda_bf16.h").is_file() for o in incs)


def test_include_dirs_found_in_a_pip_layout(tmp_path, monkeypatch):
    """A pip-only install: the headers are in site-packages/nvidia/<pkg>/include."""
    inc = tmp_path / "nvidia" / "cu12" / "include"
    (inc / "cccl").mkdir(parents=True)
    (inc / "cuda_fp16.h").write_text("")
    (inc / "cuda_bf16.h").write_text("")
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    assert K.runtime_options() == (*K.RUNTIME_OPTIONS, f"-I{inc}", f"-I{inc / 'cccl'}")


# ---------------------------------------------------------------------------------------
# which device context: a stand-in cupy that records the current device


class FakeCupy:
    """Just enough of the cupy module for CupyLauncher, recording the device that is
    current at each step (the calling thread starts on device 0)."""

    def __init__(self) -> None:
        self.current = 0
        self.events: list[tuple[str, Any, int]] = []
        fake = self

        class Device:
            def __init__(self, index: int) -> None:
                self.index = index

            def __enter__(self) -> Device:
                self.prev = fake.current
                fake.current = self.index
                return self

            def __exit__(self, *exc: object) -> None:
                fake.current = self.prev

        class Runtime:
            @staticmethod
            def getDeviceProperties(index: int) -> dict[str, int]:
                fake.events.append(("props", index, fake.current))
                return {"multiProcessorCount": 132}

        class Module:
            def __init__(self, code: str, options: tuple[str, ...], name_expressions: Any) -> None:
                self.options = options
                fake.events.append(("module", options, fake.current))

            def get_function(self, name: str) -> Any:
                fake.events.append(("load", name, fake.current))

                def launch(grid: Any, block: Any, args: Any, **kw: Any) -> None:
                    fake.events.append(("launch", kw["stream"], fake.current))

                return launch

        class Cuda(Cupy13Cuda):
            pass

        Cuda.Device = Device  # type: ignore[attr-defined]
        Cuda.runtime = Runtime  # type: ignore[attr-defined]
        self.cuda = Cuda
        self.RawModule = Module

    @contextlib.contextmanager
    def on(self, index: int) -> Iterator[None]:
        prev, self.current = self.current, index
        try:
            yield
        finally:
            self.current = prev


def test_every_launch_runs_in_its_device_context():
    cp = FakeCupy()
    streams: list[int] = []

    def current_stream(index: int) -> RawTorchStream:
        streams.append(index)
        return RawTorchStream(0x500 + index)

    launcher = L.CupyLauncher(2, cupy=cp, current_stream=current_stream)
    assert launcher.num_sms == 132
    name = K.decode_name("bfloat16", 128)
    with cp.on(0):  # the caller works on another GPU
        fn = launcher.kernel(name)
        stream = launcher.stream()
        fn((1, 1, 1), (32, 1, 1), (), stream=stream)
    with cp.on(1):
        launcher.kernel(name)((1, 1, 1), (32, 1, 1), (), stream=launcher.stream())
    kinds = {(kind, dev) for kind, _, dev in cp.events}
    assert kinds == {("props", 2), ("module", 2), ("load", 2), ("launch", 2)}
    assert streams == [2, 2]  # torch's current stream of the pool's device
    assert isinstance(stream, ExternalStream) and (stream.ptr, stream.device_id) == (0x502, 2)
    assert launcher.stream() is stream  # one CuPy wrapper per torch stream
    module_opts = next(o for kind, o, _ in cp.events if kind == "module")
    assert module_opts == K.runtime_options()  # the run-time compile gets the include dirs


def test_launchers_are_per_device():
    a = L.CupyLauncher(0, cupy=FakeCupy(), current_stream=RawTorchStream)
    b = L.CupyLauncher(3, cupy=FakeCupy(), current_stream=RawTorchStream)
    assert a.kernel(K.merge_name("float32")).index == 0
    assert b.kernel(K.merge_name("float32")).index == 3


# ---------------------------------------------------------------------------------------
# on a GPU machine: the real CuPy and torch


def _real_cuda() -> Any:
    cupy = pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return cupy


@pytest.mark.gpu
def test_real_stream_is_torchs_current_stream():
    _real_cuda()
    launcher = L.cupy_launcher(0)
    side = torch.cuda.Stream(0)
    with torch.cuda.stream(side):
        cs = launcher.stream()
    assert cs.ptr == side.cuda_stream


@pytest.mark.gpu
def test_pool_on_second_gpu_while_first_is_current():
    _real_cuda()
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    import numpy as np

    from pagedkv.device.pool import KVCachePool, paged_decode_attention

    torch.cuda.set_device(0)
    pool = KVCachePool(1, 4, 16, 1, 64, "float32", "cuda:1")
    pool.buffer.normal_()
    ref = KVCachePool(1, 4, 16, 1, 64, "float32", "cpu")
    ref.buffer.copy_(pool.buffer.cpu())
    q = torch.randn((1, 2, 64), device="cuda:1")
    tables, lens = np.array([[0, 1]], np.int32), np.array([20], np.int32)
    out = paged_decode_attention(q, pool, 0, tables, lens)
    want = paged_decode_attention(q.cpu(), ref, 0, tables, lens)
    assert torch.cuda.current_device() == 0
    assert torch.allclose(out.cpu(), want, rtol=1e-4, atol=1e-5)
