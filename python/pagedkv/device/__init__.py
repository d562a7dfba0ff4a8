"""The device room: the KV pool, its CUDA kernels, how they are launched, and the CPU
fallback. Users import ``pagedkv.KVCachePool``, ``pagedkv.paged_decode_attention`` and
``pagedkv.swap_blocks``; this package is where they live (docs/kernels.md).

- ``pool``: ``KVCachePool`` (one buffer for every layer's K and V blocks) and ``swap_blocks``
- ``pool_groups``: where each layer of a pool with KV-cache groups keeps its pages
- ``attention``: ``paged_decode_attention`` over a pool, through the manager's block tables
- ``id_checks``: validation of block ids, tables and lengths before anything is launched
- ``kernels/``: the CUDA C sources (``*.cu``), shipped in the wheel
- ``kernel_loader``: their instantiations and the compilers (CuPy at run time, NVRTC in CI)
- ``device_ops``: launch code (grid, block, argument packing), shared by the GPU and the
  tests' C++ host harness
- ``cupy_launch``: the run-time launcher (CuPy, on torch's device and stream)
- ``cpu_ops``: the torch reference ops a ``device="cpu"`` pool runs, and the kernels' oracle

Nothing here is imported by ``import pagedkv``: torch (and cupy on "cuda") load on first use.
"""
