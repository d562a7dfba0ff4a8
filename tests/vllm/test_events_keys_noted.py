"""KV events taken by another thread never carry pagedkv's digest for vLLM's hash.

The adapter hands vLLM's block hashes to the core as keys; the core publishes a stored
block under its own digest of the key, and the adapter's event translator maps the digest
back to vLLM's hash once it has noted the keys. A thread that took the events between the
core's registration and the noting got the digest. The registering call holds the events'
lock until the keys are noted; `take_events` waits for it.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_events import BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from pagedkv.vllm import KVCacheManager
from vllm_objects import make_manager, make_request


@pytest.mark.parametrize("path", ["admission", "decode"])
def test_events_taken_while_keys_are_handed_over_wait_for_their_noting(path: str) -> None:
    manager: KVCacheManager = make_manager(KVCacheManager, 64, enable_kv_cache_events=True)
    req = make_request("a", list(range(1000, 1031)))
    if path == "decode":
        # Admitted without a full block's key due later: the decode step that fills block 1
        # hands its key over on the general path (events on: it is not deferred).
        assert manager.allocate_slots(req, req.num_tokens) is not None
        req.num_computed_tokens = req.num_tokens
        req.append_output_token_ids(7)
        manager.take_events()
    translator = manager.events
    noted = translator.note_keys
    takers: list[threading.Thread] = []
    taken: list[Any] = []

    def note_with_a_taker_waiting(sid: int, keys: list[bytes] | None, start: int) -> None:
        # Another thread takes the events now, between the registration and the noting.
        taker = threading.Thread(target=lambda: taken.extend(manager.take_events()))
        taker.start()
        taker.join(0.2)
        assert taker.is_alive(), "events were taken before the keys were noted"
        takers.append(taker)
        noted(sid, keys, start)

    translator.note_keys = note_with_a_taker_waiting  # type: ignore[method-assign]
    if path == "admission":
        assert manager.allocate_slots(req, req.num_tokens) is not None
    else:
        assert manager.allocate_slots(req, 1) is not None
    assert takers, "no key was handed over: the test no longer tests the race"
    for taker in takers:
        taker.join(10)
        assert not taker.is_alive()
    stored = [h for e in taken if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored, "the taker saw no stored block"
    vllm_hashes = {maybe_convert_block_hash(h) for h in req.block_hashes}
    assert set(stored) <= vllm_hashes
