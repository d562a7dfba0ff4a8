"""Moving one page's bytes out of and into an SGLang host pool (`HostKVCache`), as the pool's
own page calls move them: `get_data_page(index, flat=True)`, `get_dummy_flat_data_page()` and
`set_from_flat_data_page(index, page)`. Every host pool of SGLang 0.5.23 has them (MHA, MLA,
Mamba, DSA indexer...), in each of its layouts, so every pool is served, and the bytes are
the ones SGLang's own file backend stores for the page.

- `read_page` returns the page's bytes as a buffer the caller must consume before the page
  is written again: the store copies it (framing, codec, or the socket write) before its
  `put` returns, so a set has copied the page out of the pool when it returns.
- `write_page` copies the bytes into the pool before it returns, so a get reports success
  only once the page is in place.

SGLang's MHA host pool (`MHATokenToKVPoolHost`, its own page calls, layouts layer_first,
page_first, page_first_direct, page_head) is read and written in place with numpy, on a
byte view of its buffer sliced as its `get_data_page` slices it (checked once per pool
against that call: same memory, same shape). numpy copied a strided 1 MiB bf16 page in
about 64 us where torch's ``flatten()`` took 1.3 ms on this 2-core machine, and the per-page
torch calls cost ~30 us more than the numpy slice. Any other pool (MLA, Mamba, a subclass
with its own page calls...) goes through its own calls: the unflattened page (every pool's
``flat=True`` is that page's ``flatten()``) gathered by numpy where numpy can view it, and
`set_from_flat_data_page` through a staging page of the pool's dtype, one per thread and
pool (SGLang's prefetch and backup threads call at once; a pinned staging page is allocated
once, not per call).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

_local = threading.local()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, as one flat buffer (a copy only if it is not contiguous)."""
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.contiguous().reshape(-1).view(torch.uint8)
    return flat.numpy().data.cast("B")


def page_nbytes(pool: Any) -> int:
    """Bytes of one page of `pool` (its dummy flat page's size)."""
    dummy = pool.get_dummy_flat_data_page()
    return int(dummy.numel() * dummy.element_size())


def _numpy_bytes(t: torch.Tensor) -> np.ndarray | None:
    """`t`'s bytes as a numpy array of its shape (last axis in bytes), without a copy; None
    where numpy cannot view it (not on the CPU, or its last axis is strided)."""
    if t.device.type != "cpu" or (t.dim() > 0 and t.stride(-1) != 1):
        return None
    return t.view(torch.uint8).numpy() if t.dim() > 0 else None


def read_page(pool: Any, index: int) -> memoryview:
    """The bytes of the page at token `index` of `pool`."""
    arr = _mha_view(pool, index)
    if arr is None:
        arr = _numpy_bytes(pool.get_data_page(index, flat=False))
    if arr is None:
        return tensor_bytes(pool.get_data_page(index, flat=True))
    return np.ascontiguousarray(arr).reshape(-1).data.cast("B")


#: Where a page sits in an MHA host pool's buffer, per layout (SGLang 0.5.23's
#: MHATokenToKVPoolHost.get_data_page): token axis 2 or 1, or page axis 1.
_MHA_TOKEN_AXIS = {"layer_first": 2, "page_first": 1}
_MHA_PAGE_AXIS = ("page_first_direct", "page_head")
_mha_lock = threading.Lock()
# Per pool, weakly: a pool SGLang drops (a detach, a test) is not kept alive here.
_mha_buffers: weakref.WeakKeyDictionary[Any, np.ndarray | None] = weakref.WeakKeyDictionary()


def _mha_slice(buf: np.ndarray, layout: str, index: int, page_size: int) -> np.ndarray | None:
    if layout in _MHA_TOKEN_AXIS:
        axis = _MHA_TOKEN_AXIS[layout]
        return buf[(slice(None),) * axis + (slice(index, index + page_size),)]
    if layout in _MHA_PAGE_AXIS:
        page = index // page_size
        return buf[:, page : page + 1]
    return None


def _mha_buffer(pool: Any) -> np.ndarray | None:
    """An MHA host pool's whole buffer as one numpy byte array, once per pool; None for any
    other pool, a layout not listed above, or a buffer numpy cannot view. Checked once
    against the pool's own `get_data_page(0, flat=False)`: same memory, same shape."""
    with _mha_lock:
        if pool in _mha_buffers:
            return _mha_buffers[pool]
    cls = type(pool)
    arr: np.ndarray | None = None
    if (
        cls.set_from_flat_data_page is MHATokenToKVPoolHost.set_from_flat_data_page
        and cls.get_data_page is MHATokenToKVPoolHost.get_data_page
        and isinstance(getattr(pool, "kv_buffer", None), torch.Tensor)
        and pool.kv_buffer.is_contiguous()
    ):
        arr = _numpy_bytes(pool.kv_buffer)
        ref = pool.get_data_page(0, flat=False)
        ours = None if arr is None else _mha_slice(arr, pool.layout, 0, pool.page_size)
        if (
            ours is None
            or ours.ctypes.data != ref.data_ptr()
            or ours.shape != (*ref.shape[:-1], ref.shape[-1] * ref.element_size())
        ):
            arr = None
    with _mha_lock:
        _mha_buffers[pool] = arr
    return arr


def _mha_view(pool: Any, index: int) -> np.ndarray | None:
    """The page at `index` of an MHA host pool as a writable numpy view of its buffer (the
    elements `get_data_page` gives and `set_from_flat_data_page` assigns), or None."""
    buf = _mha_buffer(pool)
    return None if buf is None else _mha_slice(buf, pool.layout, index, pool.page_size)


def _staging(pool: Any) -> torch.Tensor:
    pages: weakref.WeakKeyDictionary[Any, torch.Tensor] | None = getattr(_local, "pages", None)
    if pages is None:
        pages = _local.pages = weakref.WeakKeyDictionary()
    page = pages.get(pool)
    if page is None:
        page = pages[pool] = pool.get_dummy_flat_data_page()
    return page


def write_page(pool: Any, index: int, data: bytes | memoryview) -> None:
    """Copy `data` (exactly one page's bytes) into the page at token `index` of `pool`."""
    view = _mha_view(pool, index)
    if view is not None:
        src = np.frombuffer(data, dtype=np.uint8)
        if src.size != view.size:
            raise ValueError(f"a page of this pool is {view.size} bytes, got {src.size}")
        view[...] = src.reshape(view.shape)
        return
    page = _staging(pool)
    dst = page.view(torch.uint8).numpy()
    src = np.frombuffer(data, dtype=np.uint8)
    if src.size != dst.size:
        raise ValueError(f"a page of this pool is {dst.size} bytes, got {src.size}")
    dst[:] = src
    pool.set_from_flat_data_page(index, page)


def page_starts(host_indices: Any, n_pages: int, page_size: int) -> list[int]:
    """The first token index of each of `n_pages` pages in `host_indices` (SGLang passes
    every token's index, `page_size` per page); ValueError if the count does not match."""
    count = int(host_indices.numel()) if hasattr(host_indices, "numel") else len(host_indices)
    if count != n_pages * page_size:
        raise ValueError(
            f"host_indices holds {count} token indices; {n_pages} keys of "
            f"{page_size}-token pages need {n_pages * page_size}"
        )
    flat = host_indices.tolist() if hasattr(host_indices, "tolist") else list(host_indices)
    return [int(flat[i * page_size]) for i in range(n_pages)]


__all__ = ["page_nbytes", "page_starts", "read_page", "tensor_bytes", "write_page"]
