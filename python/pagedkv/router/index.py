"""`RouterIndex`: the Rust index (`pagedkv._core.RouterIndex`) with ranking, named results
and followed streams."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from pagedkv import _core
from pagedkv.errors import InvalidArgumentError

if TYPE_CHECKING:
    from pagedkv._core import _BlockHashes, _TokenIds
    from pagedkv.router.follow import Follower

EngineId = int | str


class Applied(NamedTuple):
    """What one payload changed: blocks stored and removed; `BlockStored` of blocks already
    held and `BlockRemoved` of blocks not held (nothing changed); `BlockStored` events whose
    parent the engine did not hold (orphans, recorded all the same); `AllBlocksCleared`
    events; events of an unknown type (skipped)."""

    stored: int
    removed: int
    duplicates: int
    unknown_removals: int
    orphans: int
    cleared: int
    unknown_events: int


class EngineMatch(NamedTuple):
    """One engine's answer: `blocks`, the leading blocks of the request it holds in the
    ranking's medium; `media`, the same for every medium it holds any in; `load`, what the
    caller passed for it (None when not given)."""

    engine_id: EngineId
    blocks: int
    media: dict[str | None, int]
    load: float | None


class RouterStats(NamedTuple):
    """The index at one moment (docs/router.md, "Stats")."""

    engines: int
    holders: int
    memberships: int
    entries: int
    stored: int
    removed: int
    duplicates: int
    unknown_removals: int
    orphans: int
    cleared: int
    unknown_events: int
    rejected_payloads: int
    snapshots: int
    map_bytes: int
    set_bytes: int
    other_bytes: int
    bytes: int


def _order(e: EngineId) -> tuple[bool, Any]:
    # ints before names, each in its own order: a stable tie-break for mixed ids.
    return (isinstance(e, str), e)


class RouterIndex(_core.RouterIndex):
    """Which engine holds which KV blocks, per medium ("GPU", "CPU", ...) and KV-cache group.

    `block_size`, `hash_algo`, `hash_seed`: the engines' hash settings (what `match(token_ids=)`
    hashes with, `pagedkv.hash_blocks`'s); `hash_form`: the form of the hashes the engines
    publish, "int" (vLLM's integer hashes: pagedkv's publisher by default, vLLM with
    `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`) or "bytes" (whole digests, of `hash_algo`'s width);
    `max_holders`: the most (engine, medium, group) triples at once.

    Safe to use from many threads: lookups take no lock and run while events apply.
    """

    def __init__(self, **kwargs: Any) -> None:
        # The Rust __new__ took the settings; the followers live here.
        self.followers: dict[EngineId, Follower] = {}

    def apply(self, engine_id: EngineId, payload: bytes) -> Applied:
        """Apply one `KVEventBatch` payload (msgpack bytes, as they come off vLLM's wire) to
        `engine_id`'s blocks. Raises `KVEventPayloadError`, changing nothing, for a payload
        that does not decode or carries hashes of another form."""
        # tuple.__new__: the core's tuple as an Applied, without NamedTuple's argument parsing.
        return tuple.__new__(Applied, super().apply(engine_id, payload))

    def holders(
        self,
        block_hashes: _BlockHashes | None = None,
        *,
        token_ids: _TokenIds | None = None,
        cache_salt: str | bytes | None = None,
        lora_id: int | None = None,
    ) -> list[tuple[EngineId, str | None, int, int]]:
        """Every (engine_id, medium, group, leading blocks held) with at least one block, in
        no particular order: the raw answer `match` ranks."""
        if (block_hashes is None) == (token_ids is None):
            raise InvalidArgumentError("give block_hashes or token_ids (exactly one)")
        if token_ids is None:
            assert block_hashes is not None
            return self.match_hashes(block_hashes)
        return self.match_tokens(token_ids, cache_salt=cache_salt, lora_id=lora_id)

    def match(
        self,
        block_hashes: _BlockHashes | None = None,
        *,
        token_ids: _TokenIds | None = None,
        cache_salt: str | bytes | None = None,
        lora_id: int | None = None,
        medium: str | None = "GPU",
        group: int = 0,
        loads: Mapping[EngineId, float] | None = None,
        load_weight: float = 0.0,
    ) -> list[EngineMatch]:
        """Engines ranked for a request: most leading blocks held in `medium` (of KV-cache
        group `group`) first; with `loads`, the score is blocks - `load_weight` x load and
        ties go to the lower load. Engines holding none of the request are left out, except
        those named in `loads` (so that a caller who passes every engine's load gets them
        all). The request is `block_hashes` (the engines' hashes, in the index's form) or
        `token_ids` (hashed with the index's settings, `cache_salt` and `lora_id`)."""
        found = self.holders(
            block_hashes, token_ids=token_ids, cache_salt=cache_salt, lora_id=lora_id
        )
        per: dict[EngineId, dict[str | None, int]] = {}
        for e, m, g, n in found:
            if g == group:
                per.setdefault(e, {})[m] = n
        if loads:
            for e in loads:
                per.setdefault(e, {})
        out = [
            EngineMatch(e, media.get(medium, 0), media, None if loads is None else loads.get(e))
            for e, media in per.items()
        ]
        out.sort(
            key=lambda r: (
                -(r.blocks - load_weight * (r.load or 0.0)),
                r.load or 0.0,
                _order(r.engine_id),
            )
        )
        return out

    def stats(self) -> RouterStats:  # type: ignore[override]
        """Counters and memory by the index's own accounting (docs/router.md)."""
        return RouterStats(**super().stats())

    # ---- live streams ------------------------------------------------------------------

    def follow(
        self,
        engine_id: EngineId,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        timeout: float = 5.0,
        epoch_check: float = 1.0,
    ) -> Follower:
        """Follow `engine_id`'s KV event stream (a PUB `endpoint`, pagedkv's or vLLM's) on a
        thread of its own, with the reference subscriber's recovery through
        `replay_endpoint`: gaps replayed, a restarted publisher (new epoch) or a restarted
        router resynchronised from a snapshot, all without restarting the engine. Needs
        pyzmq and msgspec. Replaces an earlier follower of the same engine."""
        from pagedkv.router.follow import Follower  # pyzmq: only when asked

        self.unfollow(engine_id)
        f = Follower(
            self,
            engine_id,
            endpoint,
            replay_endpoint,
            topic=topic,
            timeout=timeout,
            epoch_check=epoch_check,
        )
        self.followers[engine_id] = f
        return f

    def unfollow(self, engine_id: EngineId, *, remove: bool = False) -> None:
        """Stop following `engine_id` (its blocks stay unless `remove`)."""
        f = self.followers.pop(engine_id, None)
        if f is not None:
            f.close()
        if remove:
            self.remove_engine(engine_id)

    def close(self) -> None:
        """Stop every follower."""
        for e in list(self.followers):
            self.unfollow(e)

    def __enter__(self) -> RouterIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Applied", "EngineId", "EngineMatch", "RouterIndex", "RouterStats"]
