"""Every kernel instantiation compiles to sm_90 with NVRTC (no GPU or driver needed), and
ptxas reports no spills. Needs cuda-bindings with the NVRTC and CUDA-header wheels."""

from __future__ import annotations

import pytest

from pagedkv.device import kernel_loader as K

pytest.importorskip("cuda.bindings.nvrtc")

#: Register ceilings implied by __launch_bounds__ (65536 registers per SM / threads).
MAX_REGS = {"pkv_paged_decode": 64, "pkv_merge_splits": 255}


@pytest.fixture(scope="module")
def reports() -> dict[str, K.KernelReport]:
    if not K.cuda_include_dirs():
        pytest.skip("CUDA headers (nvidia-cuda-runtime wheel) not installed")
    out: dict[str, K.KernelReport] = {}
    for src in K.SOURCES:
        _cubin, reps, _log = K.compile_nvrtc(src, arch="sm_90")
        out.update({r.name: r for r in reps})
    return out


def test_every_instantiation_compiles_for_sm90(reports):
    assert sorted(reports) == sorted(K.all_name_expressions())


@pytest.mark.parametrize("name", K.all_name_expressions())
def test_no_spills(reports, name):
    r = reports[name]
    assert r.spill_stores == 0 and r.spill_loads == 0, r
    assert r.stack_frame == 0, r
    assert r.registers <= MAX_REGS.get(name.split("<")[0], 255), r


def test_ptxas_log_parser():
    log = (
        "ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_90'\n"
        "ptxas info    : Function properties for _Z3fooPf\n"
        "    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Used 40 registers, used 1 barriers, 16 bytes smem, 380 bytes cmem[0]\n"
    )
    d = K.parse_ptxas_log(log)["_Z3fooPf"]
    assert d == {
        "registers": 40,
        "spill_stores": 4,
        "spill_loads": 4,
        "stack_frame": 8,
        "shared_bytes": 16,
    }
