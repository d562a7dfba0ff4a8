"""Threads racing on caller-keyed sequences (vLLM's scheduler driving pagedkv).

Several threads allocate sequences keyed by the caller's block keys, drawn from a few shared
prompts (equal prefixes, equal keys) on top of tokens that differ per call, so that the keys
alone decide the hits. They hold registration and lift it in steps (`register`), give keys
late (`append(..., block_hashes=)`), reserve slots without tokens, cap hits, fork and free,
all at once. Every answer is checked as it comes (a hit never exceeds the keys or the cap; a
key family nobody publishes never hits), and at the end the audit passes, every block is
accounted for, and published keys hit a fresh sequence in full.
"""

from __future__ import annotations

import hashlib
import random
import threading
import traceback
from collections.abc import Callable

import pytest

from pagedkv import BlockManager, KVCacheGroup

B = 4
THREADS = 6
PROMPTS = 4
PROMPT_BLOCKS = 8  # each shared prompt: 8 full blocks


pytestmark = pytest.mark.usefixtures("fast_thread_switches")


def key(family: bytes, prompt: int, i: int) -> bytes:
    """The caller's chain key of block `i` of shared prompt `prompt`: depends on the whole
    prefix, as vLLM's block hashes do."""
    return family + hashlib.sha256(b"%d/%d" % (prompt, i)).digest()[:16]


def keys(family: bytes, prompt: int, n: int) -> list[bytes]:
    return [key(family, prompt, i) for i in range(n)]


def _run(n: int, target: Callable[[int], None]) -> None:
    barrier = threading.Barrier(n)
    errors: list[str] = []

    def body(i: int) -> None:
        try:
            barrier.wait()
            target(i)
        except BaseException:
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
        assert not t.is_alive(), "a worker thread hung"
    assert not errors, "\n".join(errors)


def _worker(m: BlockManager, t: int, rounds: int) -> None:
    rng = random.Random(t)
    live: dict[int, tuple[int, int]] = {}  # sid -> (prompt, keys given)
    next_sid = t * 1_000_000
    for _ in range(rounds):
        op = rng.randrange(10)
        if op <= 3 or not live:
            p = rng.randrange(PROMPTS)
            n_blocks = rng.randint(1, PROMPT_BLOCKS)
            n = n_blocks * B + rng.randint(0, B - 1) or 1
            given = rng.randint(max(0, n_blocks - 2), n_blocks)
            # Tokens differ per call: only the keys can make a hit.
            toks = [rng.randrange(50_000) for _ in range(n)]
            cap = rng.choice([None, None, 0, B, 3 * B])
            held = rng.random() < 0.5
            sid = next_sid
            next_sid += 1
            got = m.allocate(
                sid,
                toks,
                block_hashes=keys(b"shared", p, given),
                max_hit_tokens=cap,
                register=not held,
            )
            if got is None:
                if live:
                    m.free(live.popitem()[0])
                continue
            bound = min(given, (n - 1) // B, (cap if cap is not None else n) // B)
            assert got % B == 0 and got // B <= bound, (got, given, n, cap)
            live[sid] = (p, given)
            # A key family nobody publishes: never a hit, whatever else is cached.
            assert m.lookup(toks, block_hashes=keys(b"never", p, given)) == 0
        elif op == 4:
            sid = rng.choice(list(live))
            t_num = m.num_scheduled_tokens(sid)
            m.register(sid, num_tokens=rng.choice([None, t_num, t_num // 2]))
        elif op == 5:
            # Tokens now, their block's key later (vLLM's hash lookahead).
            sid = rng.choice(list(live))
            p, given = live[sid]
            n = m.num_tokens(sid)
            k = rng.randint(1, B)
            if m.append(sid, [rng.randrange(50_000) for _ in range(k)]) is None:
                continue
            full = (n + k) // B
            if full > given:
                more = keys(b"shared", p, full)[given:]
                assert m.append(sid, [], block_hashes=more) == [], "keys only: no block"
                live[sid] = (p, full)
        elif op == 6:
            sid = rng.choice(list(live))
            m.append(sid, [], lookahead=rng.randint(1, 2 * B))  # slots only (may not fit)
        elif op == 7:
            sid = rng.choice(list(live))
            child = next_sid
            next_sid += 1
            m.fork(sid, child)
            live[child] = live[sid]
        else:
            sid = rng.choice(list(live))
            del live[sid]
            if rng.random() < 0.3:
                m.free(sid, num_computed_tokens=m.num_scheduled_tokens(sid) // 2)
            else:
                m.free(sid)
    for sid in list(live):
        m.free(sid)


@pytest.mark.parametrize(
    "groups",
    [None, [KVCacheGroup("full"), KVCacheGroup("sliding_window", window=4 * B)]],
    ids=["plain", "full+window"],
)
def test_threads_share_caller_keys_hold_and_register(
    groups: list[KVCacheGroup] | None,
) -> None:
    m = BlockManager(160, B, groups=groups, watermark=0.0, enable_kv_events=True)
    _run(THREADS, lambda t: _worker(m, t, 1000))
    m.check_invariants()
    assert len(m) == 0
    st = m.stats()
    assert st.free_blocks + st.cached_blocks == m.num_available_blocks
    assert st.prefix_hits > 0, "equal keys hit across the threads' sequences"
    m.drain_events()
    # Published keys hit a fresh sequence in full; held ones only once registered.
    for p in range(PROMPTS):
        m.allocate(1, [1] * (3 * B + 1), block_hashes=keys(b"final", p, 3), register=False)
        assert m.lookup([2] * (3 * B + 1), block_hashes=keys(b"final", p, 3)) == 0
        assert m.register(1) == 3 * m.num_groups
        assert m.lookup([2] * (3 * B + 1), block_hashes=keys(b"final", p, 3)) == 3 * B
        m.free(1)
    m.check_invariants()


def test_threads_register_one_shared_prompt_at_once() -> None:
    """Every thread holds the same keyed prompt and registers it at once: exactly one copy
    of each block is published (the others stay unhashed), and all see it afterwards."""
    m = BlockManager(4 * THREADS * PROMPT_BLOCKS, B, watermark=0.0)
    n = PROMPT_BLOCKS * B + 1
    k = keys(b"one", 0, PROMPT_BLOCKS)
    for t in range(THREADS):
        assert m.allocate(t, [t] * n, block_hashes=k, register=False) == 0
    counts = [0] * THREADS

    def register(t: int) -> None:
        counts[t] = m.register(t)

    _run(THREADS, register)
    assert sum(counts) == PROMPT_BLOCKS, counts
    assert m.lookup([9] * n, block_hashes=k) == PROMPT_BLOCKS * B
    m.check_invariants()
