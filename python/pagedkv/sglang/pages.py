"""Moving one page's bytes out of and into an SGLang host pool (`HostKVCache`), through the
pool's own page calls: `get_data_page(index, flat=True)`, `get_dummy_flat_data_page()` and
`set_from_flat_data_page(index, page)`. Every host pool of SGLang 0.5.23 has them (MHA, MLA,
Mamba, DSA indexer...), in each of its layouts, so one path serves them all, and the bytes
are the ones SGLang's own file backend stores for the page.

- `read_page` returns the page's bytes as a buffer the caller must consume before the page
  is written again: the store copies it (framing, codec, or the socket write) before its
  `put` returns, so a set has copied the page out of the pool when it returns. It takes the
  unflattened page (`flat=False`, the same elements in the same order: every pool's
  ``flat=True`` is that page's ``flatten()``) and copies it with numpy, which gathers a
  strided bf16 page 5 to 15 times as fast as torch's ``flatten()`` on a CPU here.
- `write_page` copies the bytes into the pool before it returns, so a get reports success
  only once the page is in place. For SGLang's MHA host pool, whose page is a view of its
  buffer and whose `set_from_flat_data_page` assigns exactly that view, numpy writes the view
  directly (checked: the view must share the buffer's memory); any other pool gets its own
  `set_from_flat_data_page`, through a staging page of its dtype, one per thread and pool
  (SGLang's prefetch and backup threads call at once; a pinned staging page is allocated
  once, not per call).
"""

from __future__ import annotations

import threading
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
    arr = _numpy_bytes(pool.get_data_page(index, flat=False))
    if arr is None:
        return tensor_bytes(pool.get_data_page(index, flat=True))
    return np.ascontiguousarray(arr).reshape(-1).data.cast("B")


def _mha_view(pool: Any, index: int) -> np.ndarray | None:
    """The page at `index` of an MHA host pool as a writable numpy view of its buffer, or
    None for any other pool (or a page that is not a view of the buffer)."""
    cls = type(pool)
    if (
        cls.set_from_flat_data_page is not MHATokenToKVPoolHost.set_from_flat_data_page
        or cls.get_data_page is not MHATokenToKVPoolHost.get_data_page
    ):
        return None
    page = pool.get_data_page(index, flat=False)
    buf = pool.kv_buffer
    if page.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr():
        return None
    return _numpy_bytes(page)


def _staging(pool: Any) -> torch.Tensor:
    pages: dict[int, tuple[Any, torch.Tensor]] | None = getattr(_local, "pages", None)
    if pages is None:
        pages = _local.pages = {}
    slot = pages.get(id(pool))
    if slot is None or slot[0] is not pool:  # a new pool at a recycled id
        slot = pages[id(pool)] = (pool, pool.get_dummy_flat_data_page())
    return slot[1]


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
