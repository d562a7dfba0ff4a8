"""The KV-content oracle (tests/support/kv_oracle.py) catches what it is there to catch.

Each test runs a short program through a manager that lies in one way an engine would pay
for (a dropped copy pair, a swapped pair, a table entry, an eviction's digest, a free that
forgets what was computed) and checks that the oracle names the wrong KV; the honest
managers, Rust and reference, pass the same programs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import pagedkv
from kv_oracle import KVContentError, KVOracle
from pagedkv_reference import ReferenceBlockManager

IMPLS = [pagedkv.BlockManager, ReferenceBlockManager]


class Driven:
    """A manager and its oracle: every call goes through the oracle."""

    def __init__(self, m: Any, block_size: int, **kw: Any) -> None:
        self.m = m
        self.kv = KVOracle(block_size, **kw)

    def __call__(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self.kv.before(self.m, method, args, kwargs)
        evicted: list[Any] = []
        if method in ("allocate", "append") and self.m.record_evictions:
            kwargs = {**kwargs, "evicted": evicted}
        shown = {k: v for k, v in kwargs.items() if k != "evicted"}
        value = getattr(self.m, method)(*args, **kwargs)
        self.kv.after(self.m, method, args, shown, value, None, evicted=evicted)
        return value


class Liar:
    """A manager that passes every call through, except `method`, whose value (or
    arguments) `twist` changes."""

    def __init__(self, inner: Any, method: str, twist: Callable[..., Any]) -> None:
        self._inner, self._method, self._twist = inner, method, twist

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name != self._method:
            return attr
        return lambda *a, **kw: self._twist(attr, *a, **kw)

    def __contains__(self, sid: object) -> bool:
        return sid in self._inner


def _cow_program(d: Driven) -> None:
    d("allocate", 1, [1, 2, 3])
    d("fork", 1, 2)
    d("append", 1, [4])  # the shared partial block is copied first
    d("append", 2, [5])


def _swap_program(d: Driven) -> None:
    d("allocate", 1, [1, 2, 3, 4, 5])
    d("swap_out", 1)
    d("allocate", 2, [7, 7, 7, 7])  # takes the freed GPU blocks
    d("swap_in", 1)


def _uncomputed_program(d: Driven) -> None:
    d("allocate", 1, [1, 2, 3, 4, 5])  # scheduled, registered, then aborted before compute
    d("free", 1, num_computed_tokens=0)
    d("allocate", 2, [1, 2, 3, 4, 5])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("program", [_cow_program, _swap_program, _uncomputed_program])
def test_honest_managers_pass(impl: Any, program: Callable[[Driven], None]) -> None:
    d = Driven(impl(8, 2, num_cpu_blocks=4), 2)
    program(d)
    assert d.kv.checked > 0


@pytest.mark.parametrize("impl", IMPLS)
def test_a_dropped_copy_pair_is_caught(impl: Any) -> None:
    d = Driven(Liar(impl(8, 2), "append", lambda f, *a, **k: f(*a, **k) and []), 2)
    with pytest.raises(KVContentError, match="never written"):
        _cow_program(d)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_wrong_swap_pair_is_caught(impl: Any) -> None:
    def twist(f: Callable[..., Any], *a: Any, **k: Any) -> Any:
        pairs = f(*a, **k)
        return [(cpu, gpu) for (cpu, _), (_, gpu) in zip(pairs, reversed(pairs), strict=True)]

    d = Driven(Liar(impl(8, 2, num_cpu_blocks=4), "swap_in", twist), 2)
    with pytest.raises(KVContentError, match="sequence 1"):
        _swap_program(d)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_wrong_table_entry_is_caught(impl: Any) -> None:
    inner = impl(8, 2)

    def twist(f: Callable[..., Any], sid: int, **k: Any) -> Any:
        table = list(f(sid, **k))
        return table[::-1] if sid == 2 else table

    d = Driven(Liar(inner, "block_table", twist), 2)
    d("allocate", 1, [1, 2, 3, 4])
    with pytest.raises(KVContentError, match="instead of its own KV"):
        d("allocate", 2, [1, 2, 3, 4, 9])


@pytest.mark.parametrize("impl", IMPLS)
def test_an_eviction_under_another_digest_is_caught(impl: Any) -> None:
    def twist(f: Callable[..., Any], *a: Any, evicted: list[Any], **k: Any) -> Any:
        mine: list[Any] = []
        out = f(*a, evicted=mine, **k)
        # Report each block under the digest of the one evicted after it.
        digests = [d for _, _, d in mine]
        evicted.extend(
            (b, g, d) for (b, g, _), d in zip(mine, digests[1:] + digests[:1], strict=True)
        )
        return out

    d = Driven(Liar(impl(4, 2, record_evictions=True), "allocate", twist), 2)
    d("allocate", 1, [1, 2, 3, 4, 5])
    d("free", 1)
    with pytest.raises(KVContentError, match="evicted block"):
        d("allocate", 2, [6, 7, 8, 9, 6, 7, 8])  # evicts both cached blocks


@pytest.mark.parametrize("impl", IMPLS)
def test_a_free_that_forgets_the_computed_tokens_is_caught(impl: Any) -> None:
    def twist(f: Callable[..., Any], sid: int, **k: Any) -> Any:
        return f(sid)  # as if every scheduled token had been computed

    d = Driven(Liar(impl(8, 2), "free", twist), 2)
    with pytest.raises(KVContentError, match="uncomputed"):
        _uncomputed_program(d)


STATE_HYBRID = [pagedkv.KVCacheGroup("full"), pagedkv.KVCacheGroup("state")]


def _divergent_program(d: Driven) -> None:
    """Seed 4 blocks one per step, evict the states at boundaries 8..16 (blocks holding a
    state group entry that the cache still has), then take the full-attention hit of 16
    tokens with 2 tokens loaded past it (the state at 18 arrives with them)."""
    prompt = list(range(16))
    replay = [*prompt, 7, 7]
    d("allocate", 1, prompt, num_new_tokens=4)
    for _ in range(3):
        d("extend", 1, 4)
    d("free", 1)
    per_group = d.m.lookup_blocks_per_group(replay)
    states = per_group[1][1]
    # The state group's own hit reaches 16; keep only block 0's state.
    for i in (1, 2, 3):
        _, tables = d.m.lookup_blocks(replay, max_hit_tokens=(i + 1) * 4)
        d.m.evict_blocks([tables[1][i]])
    assert states[3] != 0 and d.m.lookup(replay) == 4
    hit = d("allocate", 2, replay, num_new_tokens=2, max_hit_tokens=16, loaded_tokens=2)
    assert hit == 16


def test_a_hit_deeper_than_a_state_group_with_its_state_loaded_passes() -> None:
    d = Driven(pagedkv.BlockManager(32, 4, groups=STATE_HYBRID), 4, num_groups=2,
               null_block=True, groups=STATE_HYBRID)  # fmt: skip
    _divergent_program(d)
    assert d.m.block_table(2, group=1)[:4] == [0, 0, 0, 0]
    assert d.kv.checked > 0


def test_a_hit_deeper_than_a_state_group_without_its_state_is_caught() -> None:
    """As if the manager served the 16-token hit with the loaded tokens left out: the state
    group has no state at 16 (its entry 3 is null) and the engine would resume from none."""

    def twist(f: Callable[..., Any], sid: int) -> Any:
        return min(f(sid), 16) if sid == 2 else f(sid)

    m = pagedkv.BlockManager(32, 4, groups=STATE_HYBRID)
    d = Driven(Liar(m, "num_scheduled_tokens", twist), 4, num_groups=2, null_block=True,
               groups=STATE_HYBRID)  # fmt: skip
    with pytest.raises(KVContentError, match=r"group 1 \(state\): entry 3 is the null block"):
        _divergent_program(d)
