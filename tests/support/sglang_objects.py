"""SGLang 0.5.23's own objects for the tests of pagedkv.sglang, built on the CPU: a KV host
pool (`MHATokenToKVPoolHost` over CPU "device" buffers; SGLang's host pools run on a CPU-only
torch as they are, no stub), a `HiCacheStorageConfig`, and a `PagedKVStore` made by SGLang's
`StorageBackendFactory` from a `dynamic` extra config, as SGLang's cache controller makes it.

Import this module only after `pytest.importorskip("sglang")`.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.device_pool_info import (
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

#: The remote tier's secret for the tests (docs/tiers.md, "Who must be trusted").
SECRET_HEX = (b"sglang-test-secret-0123456789abc").hex()
MODEL = "test-org/test-model"


def host_pool(
    *,
    layers: int = 2,
    heads: int = 2,
    head_dim: int = 16,
    page_size: int = 4,
    pages: int = 32,
    layout: str = "page_first",
    dtype: torch.dtype = torch.bfloat16,
) -> MHATokenToKVPoolHost:
    """An MHA host pool of `pages` pages (plus SGLang's padding page), unpinned, on the CPU."""
    tokens = pages * page_size
    k = tuple(torch.zeros(tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(tokens, heads, head_dim, dtype=dtype) for _ in range(layers))

    def ptrs(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)

    info = MHABufferInfo(
        buffers=KVBuffers(
            k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v), layout=KVBufferLayout.NHD
        ),
        page_size=page_size,
        head_num=heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(
        info,
        1.0,
        0,
        page_size,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=tokens,
        start_layer=0,
        end_layer=layers,
    )


def mla_pool(
    *, layers: int = 2, page_size: int = 4, pages: int = 32, layout: str = "page_first"
) -> MLATokenToKVPoolHost:
    """An MLA host pool (one latent row of 32 + 16 rope dims per token and layer, bf16)."""
    tokens = pages * page_size
    rank, rope = 32, 16
    bufs = tuple(torch.zeros(tokens, 1, rank + rope, dtype=torch.bfloat16) for _ in range(layers))
    info = MLABufferInfo(
        buffers=bufs,
        data_ptrs=torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64),
        layer_indices=tuple(range(layers)),
        device_layer_num=layers,
        page_size=page_size,
        kv_lora_rank=rank,
        qk_rope_head_dim=rope,
        kv_cache_dim=rank + rope,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    return MLATokenToKVPoolHost(
        info,
        1.0,
        0,
        page_size,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=tokens,
        start_layer=0,
        end_layer=layers,
        target_layer_num=layers,
    )


def storage_config(
    extra: dict[str, Any],
    *,
    model: str | None = MODEL,
    tp_rank: int = 0,
    tp_size: int = 1,
    is_mla: bool = False,
) -> HiCacheStorageConfig:
    """What SGLang's cache controller passes (`_generate_storage_config`), for one rank."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=is_mla,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name=model,
        extra_config=dict(extra),
    )


def dynamic_extra(**options: Any) -> dict[str, Any]:
    """SGLang's extra config for `--hicache-storage-backend dynamic` naming PagedKVStore."""
    return {
        "backend_name": "pagedkv",
        "module_path": "pagedkv.sglang",
        "class_name": "PagedKVStore",
        "interface_v1": 1,
        **options,
    }


def make_store(pool: Any, extra: dict[str, Any], **config: Any) -> HiCacheStorage:
    """Built by SGLang's factory and given the host pool, as `attach_storage_backend` does."""
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra, **config), pool)
    backend.register_mem_pool_host(pool)
    return backend


def fill_pages(pool: Any, seed: int) -> None:
    """Random KV in every page of the pool (a different pattern for each seed)."""
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g).to(pool.kv_buffer.dtype))


def page_of(pool: Any, page: int) -> bytes:
    """The bytes of page number `page` (SGLang's flat page, as its file backend stores it)."""
    t = pool.get_data_page(page * pool.page_size, flat=True).contiguous()
    return bytes(t.view(torch.uint8).numpy())


def indices(pages: list[int], page_size: int) -> torch.Tensor:
    """SGLang's host_indices for these pages: every token's index, page after page."""
    return torch.tensor(
        [p * page_size + t for p in pages for t in range(page_size)], dtype=torch.int64
    )


def keys(n: int, tag: str = "p") -> list[str]:
    """Page keys shaped as SGLang's (64 hex digits)."""
    import hashlib

    return [hashlib.sha256(f"{tag}{i}".encode()).hexdigest() for i in range(n)]
