"""The adapter honours vLLM's `prefix_cache_retention_interval` as vLLM's own manager does:
the same refusals of bad settings, the same shared-prefix junction from the lookup
(`get_computed_blocks`' third value) and the same hits, call by call, on a stream built to
need the junction. (The scheduler-level differential is tests/vllm/test_window_hits.py.)"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
from vllm.v1.request import RequestStatus

from vllm_objects import (
    KVCacheManager,
    VllmKVCacheManager,
    full_spec,
    kv_cache_config,
    make_request,
    window_spec,
)

init_none_hash(sha256)
BS = 16
HYBRID = [full_spec(BS), window_spec(32, BS)]  # the window reads 2 blocks


def config(specs: list[KVCacheSpec], interval: int | None, num_blocks: int = 64) -> KVCacheConfig:
    c = kv_cache_config(num_blocks, specs)
    c.prefix_cache_retention_interval = interval
    return c


def build(cls: type[Any], specs: list[KVCacheSpec], interval: int | None) -> Any:
    return cls(
        kv_cache_config=config(specs, interval),
        max_model_len=4096,
        scheduler_block_size=BS,
        hash_block_size=BS,
    )


@pytest.mark.parametrize(
    ("specs", "interval"),
    [(HYBRID, 24), (HYBRID, 8), ([full_spec(BS)], 32), ([full_spec(BS)], 16)],
)
def test_bad_settings_raise_as_vllm_raises(specs: list[KVCacheSpec], interval: int) -> None:
    with pytest.raises(ValueError) as theirs:
        build(VllmKVCacheManager, specs, interval)
    with pytest.raises(ValueError) as ours:
        build(KVCacheManager, specs, interval)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize(("specs", "interval"), [(HYBRID, 0), (HYBRID, 64), ([full_spec(BS)], 0)])
def test_good_settings_build(specs: list[KVCacheSpec], interval: int) -> None:
    build(VllmKVCacheManager, specs, interval)
    assert build(KVCacheManager, specs, interval).core.num_groups == len(specs)


def test_eagle_keeps_windows_dense_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """A documented gap (docs/vllm.md): vLLM shifts the tails for EAGLE; pagedkv caches the
    window densely then, and logs it."""
    m = KVCacheManager(
        kv_cache_config=config(HYBRID, 0),
        max_model_len=4096,
        scheduler_block_size=BS,
        hash_block_size=BS,
        use_eagle=True,
    )
    assert m.retention_interval is None
    assert "window groups with EAGLE stay dense" in caplog.text


def run(cls: type[Any], interval: int | None) -> list[tuple[int, int]]:
    """A prompt of 8 blocks, freed; then three prompts sharing its first 4 blocks and
    each other's first 5, one after another, each computed whole and freed. Returns each
    lookup's (hit, junction) as the scheduler takes them."""
    m = build(cls, HYBRID, interval)
    head = list(range(1000, 1000 + 4 * BS))
    prompts = [
        [*head, *range(4 * BS)],
        [*head, *range(2000, 2000 + BS), *range(3000, 3000 + 3 * BS + 3)],
        [*head, *range(2000, 2000 + BS), *range(4000, 4000 + 2 * BS + 5)],
        [*head, *range(2000, 2000 + BS), *range(5000, 5000 + 2 * BS + 9)],
    ]
    seen = []
    for i, p in enumerate(prompts):
        req = make_request(f"r{i}", p, block_size=BS)
        blocks, hit, junction = m.get_computed_blocks(req)
        req.shared_prefix_boundary = junction  # what vLLM's scheduler does with it
        seen.append((hit, junction))
        assert m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None
        req.num_computed_tokens = req.num_tokens
        req.status = RequestStatus.RUNNING
        m.free(req)
    return seen


@pytest.mark.parametrize("interval", [None, 0, 64])
def test_hits_and_junctions_equal_vllms(interval: int | None) -> None:
    assert run(KVCacheManager, interval) == run(VllmKVCacheManager, interval)


def test_the_junction_keeps_the_shared_prefix_hittable() -> None:
    """Under 0 the second prompt misses (the first kept only the window tail before its own
    end) and reports the junction at the 4 blocks full attention serves; it keeps the tail
    before that junction, so the third hits those 4 blocks and reports the next junction,
    at the 5 it shares with the second, which lets the fourth hit 5. Dense, each hits all it
    shares; with segments of 64 tokens the tail before 64 is kept anyway."""
    assert run(KVCacheManager, 0) == [(0, 0), (0, 64), (64, 80), (80, 0)]
    assert run(KVCacheManager, None) == [(0, 0), (64, 0), (80, 0), (80, 0)]
    assert run(KVCacheManager, 64) == [(0, 0), (64, 0), (64, 80), (80, 0)]
